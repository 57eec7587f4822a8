"""Step time of a layout: compute per pipeline stage, communication per mesh axis, the pipeline
bubble from the schedule simulator, and what overlaps.

Compute: every GEMM the layout produces on one GPU (fused QKV, attention output, MLP in/out,
the output head) is timed by a roofline with shape-dependent efficiency,
``max(2mnk / (peak * eff * q(m) q(n) q(k)), bytes / HBM bandwidth) + launch``, where ``q`` is
tile quantisation (a dimension uses ``x / ceil(x/128)*128`` of its tiles): thin tensor-parallel
shards and small micro-batches lose efficiency by shape, not by a fitted factor. Attention
cores, norms, activations and the cross-entropy are memory-bound element-wise passes. Backward
GEMMs are twice the forward (input and weight gradient; ZB-H1 runs them as B and W).

Communication (payload formulas the comm counter checks): tensor parallelism all-reduces one
``b*s*h`` activation twice per layer forward and twice backward (all-gather + reduce-scatter under
SP, the same wire bytes), on the critical path; data parallelism all-reduces the stage's
gradients once per step (ring: ``2(n-1)/n`` of the bytes), overlapped with the last micro-batch's
backward only without pipelining (the runtime reduces after the flush when pp > 1); ZeRO-3 adds
parameter all-gathers per micro-batch; pipeline p2p sends one activation per stage boundary per
micro-batch; ring attention passes K/V ``cp - 1`` times per layer, hidden behind attention compute
when it can be. Each axis uses NVLink if its ring fits in a node (tp innermost, then cp, dp, pp)
and the network otherwise (:meth:`Cluster.axis_bandwidth`).

The bubble: :func:`hybridpar.parallel.pipeline.simulate.simulate` runs the real schedule with
these per-action costs. For many micro-batches it simulates ``2 * pp`` of them and adds the
remainder at the bottleneck rank's steady-state rate (exact for periodic steady states).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from hybridpar.config import ModelConfig
from hybridpar.parallel.pipeline.partition import partition_model
from hybridpar.parallel.pipeline.schedules import build_schedule
from hybridpar.parallel.pipeline.simulate import Costs, simulate
from hybridpar.planner.hardware import Cluster, GPUSpec
from hybridpar.planner.layout import Layout, Workload
from hybridpar.planner.memory import numel, padded, rank_param_shapes

TILE = 128  # GEMM tile edge used for quantisation (cuBLAS/CUTLASS bf16 tiles are 128-256 wide)
FLASH_EFFICIENCY = 0.7  # FlashAttention-2 forward reaches ~70% of A100 peak (Dao 2023, fig. 4)


def _q(x: float) -> float:
    return x / (math.ceil(x / TILE) * TILE)


def gemm_time(m: float, n: float, k: float, gpu: GPUSpec, ab: int) -> float:
    """Seconds for one ``[m, k] @ [k, n]`` GEMM (roofline with tile quantisation)."""
    flops = 2.0 * m * n * k
    eff = gpu.gemm_efficiency * _q(m) * _q(n) * _q(k)
    mem = ab * (m * k + k * n + m * n) / gpu.hbm_bw
    return max(flops / (gpu.bf16_flops * eff), mem) + gpu.launch_overhead


def ring_time(nbytes: float, n: int, bw: float, lat: float, factor: float = 2.0) -> float:
    """A ring collective over ``n`` ranks moving ``factor * (n-1)/n * nbytes`` per rank
    (all-reduce 2, all-gather or reduce-scatter 1) with ``factor * (n-1)`` latency steps."""
    if n <= 1:
        return 0.0
    return factor * (n - 1) / n * nbytes / bw + factor * (n - 1) * lat


@dataclass(frozen=True)
class LayerTime:
    """Seconds per micro-batch for one layer on one GPU: forward, input-gradient backward,
    weight-gradient backward, and the tensor-parallel communication inside them."""

    f: float
    b: float
    w: float
    tp_comm: float


def layer_time(model: ModelConfig, layout: Layout, work: Workload, cluster: Cluster,
               style: str = "llama") -> LayerTime:
    """One decoder layer's compute and tp communication for one micro-batch (see module doc)."""
    g, ab, t, L = cluster.gpu, work.act_bytes, layout.tp, layout
    s = work.seq_len // L.cp
    tok = L.micro_batch * s
    h, a = model.dim, model.n_heads
    q, kv = h, model.n_kv_heads * model.head_dim
    if style == "gpt":  # 4h GELU MLP of the same parameter count as the preset's SwiGLU
        mlp = [(tok, 3 * model.ffn_hidden / 2 / t, h), (tok, h, 3 * model.ffn_hidden / 2 / t)]
        f_inner = 3 * model.ffn_hidden / 2
    else:
        mlp = [(tok, 2 * model.ffn_hidden / t, h), (tok, h, model.ffn_hidden / t)]
        f_inner = model.ffn_hidden
    gemms = [(tok, (q + 2 * kv) / t, h), (tok, h, q / t), *mlp]
    fwd_gemm = sum(gemm_time(m, n, k, g, ab) for m, n, k in gemms)
    # attention core over the full (cp-gathered) keys
    s_kv = work.seq_len
    if style == "gpt":  # unfused: batched QK^T and AV GEMMs + scale-mask-softmax + dropout
        heads = L.micro_batch * a / t
        core = heads * 2 * gemm_time(s, s_kv, h / a, g, ab)
        core += heads * s * s_kv * 9 / g.hbm_bw  # softmax in/out, mask, dropout in/out (bytes)
    else:  # fused causal SDPA: half the score matrix is computed
        core = 4 * tok * s_kv * h / t / 2 / (g.bf16_flops * FLASH_EFFICIENCY)
    sp = t if L.sequence_parallel else 1
    elem = tok * ab * (14 * h / sp + 6 * (q + kv) / t + 4 * f_inner / t) / g.hbm_bw
    tp_bw, tp_lat, _ = cluster.axis_bandwidth(t, 1)
    ar = ring_time(tok * h * ab, t, tp_bw, tp_lat)
    cp_pass = 0.0
    if L.cp > 1:
        cp_bw, cp_lat, _ = cluster.axis_bandwidth(L.cp, t)
        cp_pass = (L.cp - 1) * (2 * tok * kv / t * ab / cp_bw + cp_lat)
    f = fwd_gemm + core + elem + max(0.0, cp_pass - core) + 2 * ar
    b_time = fwd_gemm + (2.5 if style != "gpt" else 2.0) * core + 2 * elem + max(0.0, 2 * cp_pass - core) + 2 * ar
    w_time = fwd_gemm
    if L.recompute == "full":
        b_time += f
    elif L.recompute == "selective":
        b_time += core
    tp_comm = (4 + (2 if L.recompute == "full" else 0)) * ar
    return LayerTime(f, b_time, w_time, tp_comm)


@dataclass
class CostReport:
    """Predicted step time and its parts (seconds), and the derived rates."""

    step_time_s: float
    mfu: float
    tflops_per_gpu: float  # model FLOPs (recompute not counted)
    hw_tflops_per_gpu: float  # hardware FLOPs (recompute counted, as Megatron-LM reports)
    tokens_per_s: float
    terms: dict[str, float] = field(default_factory=dict)
    bubble_fraction: float = 0.0


@functools.lru_cache(maxsize=4096)
def _makespan(kind: str, pp: int, v: int, m: int, f: float, b: float, w: float, p2p: float,
              scale: tuple[float, ...]) -> float:
    sched = build_schedule(kind, pp, v, m)
    return simulate(sched, Costs(f, b, w, p2p, scale).per_chunk(v)).makespan


def pipeline_makespan(kind: str, pp: int, v: int, m: int, lt: LayerTime, p2p: float,
                      scale: tuple[float, ...]) -> float:
    """Makespan of ``m`` micro-batches through the schedule with stage costs ``lt`` scaled per
    stage; long runs are simulated for ``2 * pp`` micro-batches and extrapolated."""
    cap = 2 * pp
    if m <= cap:
        return _makespan(kind, pp, v, m, lt.f, lt.b, lt.w, p2p, scale)
    base = _makespan(kind, pp, v, cap, lt.f, lt.b, lt.w, p2p, scale)
    per_rank = [sum(scale[c * pp + r] for c in range(v)) / v for r in range(pp)]
    return base + (m - cap) * max(per_rank) * (lt.f + lt.b + lt.w)


def model_flops(model: ModelConfig, work: Workload) -> float:
    """Model FLOPs of one step: ``flops_per_token(seq) * tokens`` (PaLM accounting)."""
    return model.flops_per_token(work.seq_len) * work.global_batch * work.seq_len


def recompute_flops(model: ModelConfig, layout: Layout, work: Workload) -> float:
    """Extra forward FLOPs recomputation adds per step (layers only, not the head)."""
    tokens = work.global_batch * work.seq_len
    attn = 4.0 * model.n_layers * model.dim * work.seq_len * tokens
    if layout.recompute == "full":
        layer_matmul = (model.num_params() - model.vocab_size * model.dim * (1 if model.tie_embeddings else 2)
                        - model.dim * (2 * model.n_layers + 1))
        return 2.0 * layer_matmul * tokens + attn
    return attn if layout.recompute == "selective" else 0.0


def step_cost(model: ModelConfig, layout: Layout, work: Workload, cluster: Cluster,
              style: str = "llama") -> CostReport:
    """Predicted time of one optimizer step and its terms (see the module docstring)."""
    g, L, ab, t, pp, v = cluster.gpu, layout, work.act_bytes, layout.tp, layout.pp, layout.virtual_stages
    m = L.microbatches(work.global_batch)
    s = work.seq_len // L.cp
    tok = L.micro_batch * s
    lt = layer_time(model, L, work, cluster, style)
    vocab = padded(model.vocab_size, t) / t
    head_f = gemm_time(tok, vocab, model.dim, g, ab) + 3 * tok * vocab * (ab + 4) / g.hbm_bw
    tp_bw, tp_lat, _ = cluster.axis_bandwidth(t, 1)
    emb_f = ring_time(tok * model.dim * ab, t, tp_bw, tp_lat)  # vocab-parallel embedding
    part = partition_model(model, pp, v)
    stage_cost = []
    for c in part.chunks:
        cost = len(c.layers) * (lt.f + lt.b + lt.w)
        cost += (3 * head_f if c.head else 0.0) + (2 * emb_f if c.embedding else 0.0)
        stage_cost.append(cost)
    per_stage_layers = model.n_layers / (pp * v)
    unit = per_stage_layers * (lt.f + lt.b + lt.w)
    scale = tuple(round(x / unit, 6) for x in stage_cost)
    stage_lt = LayerTime(lt.f * per_stage_layers * v, lt.b * per_stage_layers * v,
                         lt.w * per_stage_layers * v, 0.0)
    p2p = 0.0
    if pp > 1:
        pp_bw, pp_lat, _ = cluster.axis_bandwidth(pp, t * L.cp * L.dp)
        p2p = tok * model.dim * ab / (t if L.sequence_parallel else 1) / (pp_bw / g.comm_efficiency) + pp_lat
        kind = L.pipeline_schedule
        span = pipeline_makespan(kind, pp, v, m, stage_lt, p2p, scale)
    else:
        span = m * (stage_lt.f + stage_lt.b + stage_lt.w) * scale[0]
    busy = m * max(sum(scale[c * pp + r] for c in range(v)) / v for r in range(pp)) * (
        stage_lt.f + stage_lt.b + stage_lt.w)
    # data parallel gradient reduction over dp x cp (stride tp)
    shapes = max((rank_param_shapes(model, t, pp, v, r) for r in range(pp)), key=numel)
    grad_bytes = numel(shapes) * work.param_bytes
    n = L.dp * L.cp
    dp_bw, dp_lat, _ = cluster.axis_bandwidth(n, t)
    dp_comm = ring_time(grad_bytes, n, dp_bw, dp_lat)
    last_backward = (stage_lt.b + stage_lt.w) / v * max(scale)
    if L.zero_stage == 3:
        gather = ring_time(grad_bytes, n, dp_bw, dp_lat, factor=1.0)
        exposed_z3 = m * (max(0.0, gather - stage_lt.f) + max(0.0, gather - stage_lt.b))
        dp_comm = ring_time(grad_bytes, n, dp_bw, dp_lat, factor=1.0) + exposed_z3
    dp_exposed = max(0.0, dp_comm - last_backward) if pp == 1 else dp_comm
    shard = numel(shapes, n if L.zero_stage >= 1 else 1)
    opt = shard * (2 * work.param_bytes + 28) / g.hbm_bw  # read p, g, m, v, master; write p, m, v, master
    if L.offload_optimizer:
        opt = shard * 2 * work.param_bytes / g.host_bw + shard * 28 / 100e9  # + host Adam at ~100 GB/s DRAM
    step = span + dp_exposed + opt
    flops = model_flops(model, work)
    hw = flops + recompute_flops(model, L, work)
    world = L.world_size
    terms = {"pipeline_makespan": span, "compute_busy": busy, "bubble": max(0.0, span - busy),
             "tp_comm": m * lt.tp_comm * per_stage_layers * v, "pp_p2p_per_message": p2p,
             "dp_comm": dp_comm, "dp_exposed": dp_exposed, "optimizer": opt,
             "layer_fwd": lt.f, "layer_bwd": lt.b + lt.w}
    return CostReport(step_time_s=step, mfu=flops / (step * world * g.bf16_flops),
                      tflops_per_gpu=flops / (step * world) / 1e12,
                      hw_tflops_per_gpu=hw / (step * world) / 1e12,
                      tokens_per_s=work.global_batch * work.seq_len / step, terms=terms,
                      bubble_fraction=max(0.0, span - busy) / span if span > 0 else 0.0)
