"""Step time of a layout: compute per pipeline stage, communication per mesh axis, the pipeline
bubble from the schedule simulator, and what overlaps.

Compute: every kernel is priced by its class (:mod:`hybridpar.planner.machine.efficiency`, which states
the sources): every GEMM the layout produces on one GPU (fused QKV, attention output, MLP in/out,
the output head) by a roofline whose efficiency falls with its shape (tile quantisation and
small dimensions: thin tensor-parallel shards and small micro-batches lose efficiency by shape,
not by a fitted factor); fused attention from its own FLOPs at the attention kernel's efficiency
with a memory-bound floor; norms, activations, RoPE and the cross-entropy as memory-bound passes
over the achieved bandwidth; and a layer never faster than the host can issue its kernels
(the launch floor, which binds for small models). Backward
GEMMs are the input- and weight-gradient GEMMs, priced by their own shapes (ZB-H1 runs them as
B and W: W runs only the linears' weight-gradient GEMMs, :mod:`hybridpar.parallel.pipeline.wsplit`). The
block is the workload's ``style`` (:class:`~hybridpar.planner.model.layout.BlockStyle`):
``BlockStyle.EAGER`` is this runtime's eager block (separate q/k/v/o and w1/w3/w2 GEMMs, unfused
element-wise ops, :func:`eager_elementwise_bytes`); ``BlockStyle.COMPILED`` the same block under
``train.compile`` (element-wise ops fused: :func:`fused_elementwise_elements`);
``BlockStyle.MEGATRON`` is Megatron-LM's fused GPT block.

With a calibrated profile (``hybridpar calibrate``; :class:`hybridpar.planner.machine.hardware.Calibration`)
the measured rates replace peak x efficiency: GEMM FLOP/s interpolated on the measured shape grid,
attention FLOP/s by (sequence, head dim), the measured element-wise bandwidth and an eager
block's fixed cost, each scaled by what sharing the chip costs when ``gpus_per_node`` ranks
compute at once (:attr:`Cluster.rank_gpu`); collectives take the measured ``alpha + beta *
bytes`` of their op and axis size (:meth:`Cluster.collective_time`).

Communication (payload formulas the comm counter checks): tensor parallelism all-reduces one
``b*s*h`` activation twice per layer forward and twice backward (all-gather + reduce-scatter under
SP, the same wire bytes), on the critical path; data parallelism all-reduces the stage's
gradients once per step in ``bucket_mb`` buckets (ring: ``2(n-1)/n`` of the bytes), overlapped
with the last micro-batch's backward only without pipelining (the runtime reduces after the
flush when pp > 1) and never the last bucket, which fills when backward ends; ZeRO-3 adds
parameter all-gathers per micro-batch (under pp: one per chunk and step); pipeline p2p sends one activation per stage boundary per
micro-batch; ring attention passes K/V ``cp - 1`` times per layer, hidden behind attention compute
when it can be. Each axis uses NVLink if its ring fits in a node (tp innermost, then cp, dp, pp)
and the network otherwise (:meth:`Cluster.axis_bandwidth`).

Mixture of experts (:mod:`hybridpar.planner.model.moe`): an MoE layer's feed-forward is the router GEMM on the rank's
own tokens, the busiest ep rank's ``E/ep`` expert GEMMs over ``load * k`` rows per token of its
tp group (the routing imbalance; ``load`` = 1 at ep = 1, where each rank computes its own
tokens' slots), shared experts as a dense MLP, the routing's gathers and scatters, and four
all-to-alls (dispatch and combine, forward and backward, :func:`hybridpar.planner.price.rates.all_to_all_time`) plus the
counts' exchange, all on the critical path (the runtime waits for them). Experts' gradients
reduce over ``edp`` (dp x cp / ep ranks, stride tp x ep) beside the dense ones over dp x cp.

The bubble: :func:`hybridpar.parallel.pipeline.simulate.simulate` runs the real schedule with
these per-action costs (its arithmetic on compiled action lists, :mod:`hybridpar.planner.price.pipesim`). For many
micro-batches it simulates ``2 * pp`` of them and adds the remainder at the bottleneck rank's
steady-state rate (exact for periodic steady states). The data-parallel and optimizer terms are
:mod:`hybridpar.planner.price.dp_cost`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass, field

from hybridpar.config import ModelConfig
from hybridpar.parallel.pipeline.schedules import rank_stages
from hybridpar.planner.machine import efficiency as eff
from hybridpar.planner.machine.hardware import Cluster, GPUSpec
from hybridpar.planner.machine.memo import IdentityMemo
from hybridpar.planner.memory.offload import offload_layer_times
from hybridpar.planner.model import sac
from hybridpar.planner.model.layout import BlockStyle, Layout, Workload, model_key
from hybridpar.planner.model.mla import mla_core_width, mla_gemms
from hybridpar.planner.model.moe import dispatch_rows, rank_load
from hybridpar.planner.model.shapes import layer_partition, padded, v_shaped
from hybridpar.planner.price import pipesim
from hybridpar.planner.price.cp import cp_times
from hybridpar.planner.price.dp_cost import dp_time, gradients, optimizer_time
from hybridpar.planner.price.flops import model_flops, recompute_flops
from hybridpar.planner.price.fp8 import fp8_gemm_deltas
from hybridpar.planner.price.rates import all_to_all_time, clip_time, weight_traffic


def peak_flops(gpu: GPUSpec, ab: int) -> float:
    """Dense matmul peak for ``ab``-byte operands: fp32 (4 bytes) or bf16/fp16."""
    return gpu.fp32_flops if ab == 4 else gpu.bf16_flops


def gemm_time(m: float, n: float, k: float, gpu: GPUSpec, ab: int) -> float:
    """Seconds for one ``[m, k] @ [k, n]`` GEMM: the calibrated rate for this shape when the
    spec has a measured table (carried to another dtype by the ratio of peaks), else the
    roofline with tile quantisation."""
    flops = 2.0 * m * n * k
    cal = gpu.calibration
    rate = cal.gemm_rate(m, n, k) if cal is not None else None
    if rate is not None:
        assert cal is not None
        return flops / (rate * peak_flops(gpu, ab) / peak_flops(gpu, cal.dtype_bytes)) * eff.efficiency_of(gpu).fit[0]
    return eff.gemm_device_time(m, n, k, peak_flops(gpu, ab), gpu, ab)


def overlap_fraction(gpu: GPUSpec) -> float:
    """How much of an asynchronous collective compute on the same device hides: measured by
    ``hybridpar calibrate`` (CPU backends share the cores), else 1 (GPU copy engines and NCCL
    run beside the kernels)."""
    cal = gpu.calibration
    return cal.overlap if cal is not None and cal.overlap is not None else 1.0


def gemm_backward_time(m: float, n: float, k: float, gpu: GPUSpec, ab: int) -> tuple[float, float]:
    """(input-gradient, weight-gradient) seconds of the forward GEMM ``[m, k] @ [k, n]``:
    ``dX = dY [m, n] @ W^T [n, k]`` and ``dW = X^T [k, m] @ dY [m, n]``, priced by their own
    shapes (the same as the forward under the roofline, not under a measured table)."""
    return gemm_time(m, k, n, gpu, ab), gemm_time(k, n, m, gpu, ab)


# Element-wise kernels one eager Llama block launches (counted with a TorchDispatchMode over
# hybridpar.models.llama.Block): forward RMSNorm 2 x 6, RoPE 2 x 5, SwiGLU 2, residual adds 2;
# backward 48.
EAGER_KERNELS = (26, 48)


def eager_elementwise_bytes(h: float, q: float, kv: float, f: float, act_bytes: int,
                            residual_bytes: int) -> tuple[float, float]:
    """(forward, backward) bytes read plus written per token by the element-wise ops of one eager
    Llama block (:class:`hybridpar.models.llama.Block`), for per-rank widths ``h`` (hidden, per
    sequence shard), ``q`` / ``kv`` (query / key-value heads x head dim) and ``f`` (MLP hidden).
    Counted with a TorchDispatchMode over the block at several widths
    (``benchmarks/planner_kernels.py``; ``tests/test_planner_kernels.py`` checks it):

    * fp32: ``4 x`` the elements of RMSNorm ``pow, mean, x*r, w*x`` (7h each, x2), two residual
      adds (3h each), RoPE ``x*cos, -x2, cat, x*sin, add`` (10 per element of q and of k) and
      ``silu(a) * b`` (5f); backward ``4 x (63h + 12q + 12kv + 9f)``;
    * bf16 with half parameters: RMSNorm and RoPE run in fp32 (``x.float()``, cast back), so
      forward ``84h + 52(q + kv) + 10f``, backward ``213h + 56q + 58kv + 18f``;
    * bf16 under autocast (fp32 parameters and residual stream, bf16 matmuls): the norms read
      and write the fp32 residual and their weight products stay fp32: forward ``106h + 52(q +
      kv) + 10f``, backward ``285h + 56q + 58kv + 18f``."""
    if act_bytes == 4:
        return 4 * (20 * h + 10 * q + 10 * kv + 5 * f), 4 * (63 * h + 12 * q + 12 * kv + 9 * f)
    norms_f, norms_b = (84, 213) if residual_bytes == 2 else (106, 285)
    return norms_f * h + 52 * (q + kv) + 10 * f, norms_b * h + 56 * q + 58 * kv + 18 * f


def fused_elementwise_elements(h: float, q: float, kv: float, f: float) -> tuple[float, float]:
    """(forward, backward) elements per token of the same block's element-wise work fused by
    Inductor (``BlockStyle.COMPILED``): each fused kernel reads its inputs once and writes its
    outputs once. Forward: two RMSNorms (read h, write h and its bf16 cast: 3h each), RoPE of q
    and k (read and write), ``silu(a) * b`` (read 2f, write f), two residual adds (3h each);
    backward about twice that (each pass also reads the output gradient and writes the input's)."""
    fwd = 12 * h + 2 * (q + kv) + 3 * f
    return fwd, 2 * fwd


# Kernels one block launches besides its GEMMs and attention (forward, backward): the eager
# block's element-wise kernels (EAGER_KERNELS), and under torch.compile Inductor's fused kernels
# (about one per norm, RoPE, SwiGLU and residual region).
COMPILED_KERNELS = (6, 12)


@dataclass(frozen=True)
class LayerTime:
    """Seconds per micro-batch for one layer on one GPU: forward, input-gradient backward,
    weight-gradient backward, and the tensor-parallel communication inside them."""

    f: float
    b: float
    w: float
    tp_comm: float
    ep_comm: float = 0.0  # expert-parallel all-to-alls (MoE layers), forward and backward


def _moe_ffn(model: ModelConfig, L: Layout, work: Workload, cluster: Cluster,
             tok: int) -> tuple[list[tuple[float, float, float, float]], float, float, float]:
    """An MoE feed-forward on the busiest ep rank, per micro-batch of ``tok`` tokens in its tp
    group: ``(GEMMs as (count, m, n, k), expert hidden per token for the element-wise passes,
    extra element-wise elements per token (the routing's gathers and scatters), one
    all-to-all's seconds)``. The router runs on the rank's own tokens; the rank's ``E/ep``
    experts (``H/tp`` wide) compute ``load * k * tok`` rows (:mod:`hybridpar.planner.model.moe`), as
    ``E/ep`` GEMMs of the mean rows per expert; shared experts are a dense MLP. Each dispatch or
    combine all-to-all moves the rows the busiest rank receives (its largest direction)."""
    t, h, k = L.tp, model.dim, model.experts_per_token
    load = rank_load(work.moe_imbalance, L.ep, model.n_experts)
    _, received, rows = dispatch_rows(tok, k, L.ep, load)
    per = model.n_experts // L.ep
    hid = model.expert_hidden / t
    own = tok / (t if L.sequence_parallel else 1)
    gemms = [(1.0, own, model.n_experts, h)] + [(per, rows / per, hid, h)] * 2 + [(per, rows / per, h, hid)]
    shared = model.n_shared_experts * model.expert_hidden
    if shared:
        gemms += [(1.0, tok, shared / t, h)] * 2 + [(1.0, tok, h, shared / t)]
    a2a = all_to_all_time(cluster, received * h * work.act_bytes, L.ep, t)
    return gemms, rows / tok * model.expert_hidden + shared, (6 + 4 * load) * k * h, a2a


def _block_gemms(model: ModelConfig, L: Layout, work: Workload, cluster: Cluster, tok: int,
                 moe: bool) -> tuple[list[tuple[float, float, float]], list[tuple[float, float, float, float]],
                                     float, float, float]:
    """The GEMMs of one block (``work.style``) on ``tok`` tokens: the dense block's as ``(m, n, k)``,
    those it runs as ``(count, m, n, k)`` (an MoE layer's experts replace the MLP: :func:`_moe_ffn`),
    the MLP's hidden width for the element-wise passes, the routing's element-wise elements per
    token and one expert all-to-all's seconds."""
    t, h = L.tp, model.dim
    q, kv = h, model.n_kv_heads * model.head_dim
    megatron = work.style is BlockStyle.MEGATRON
    if megatron:  # 4h GELU MLP of the same parameter count as the preset's SwiGLU; fused QKV
        f_inner = 3 * model.ffn_hidden / 2
        gemms = [(tok, (q + 2 * kv) / t, h), (tok, h, q / t), (tok, f_inner / t, h), (tok, h, f_inner / t)]
    else:  # this runtime's Llama block: separate q, k, v, o and w1, w3, w2 projections (or DeepSeek's MLA)
        f_inner = model.ffn_hidden
        attn = mla_gemms(model, t, tok) if model.mla else [(tok, q / t, h), (tok, kv / t, h), (tok, kv / t, h),
                                                          (tok, h, q / t)]
        gemms = [*attn, (tok, f_inner / t, h), (tok, f_inner / t, h), (tok, h, f_inner / t)]
    counted = [(1.0, m, n, k) for m, n, k in gemms]
    routing, a2a = 0.0, 0.0
    if moe:
        counted = counted[:-(2 if megatron else 3)]
        ffn, f_inner, routing, a2a = _moe_ffn(model, L, work, cluster, tok)
        counted += ffn
    return gemms, counted, f_inner, routing, a2a  # type: ignore[return-value]


def _attention_core(model: ModelConfig, L: Layout, work: Workload, g: GPUSpec, s: int,
                    tok: int) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core over the full (cp-gathered) keys."""
    ab, t, h, a = work.act_bytes, L.tp, model.dim, model.n_heads
    h = mla_core_width(model)[0] if model.mla else h  # MLA: Llama's core, the values padded to qk
    s_kv = work.seq_len
    if work.style is BlockStyle.MEGATRON:  # unfused: batched QK^T and AV GEMMs + scale-mask-softmax + dropout
        heads = L.micro_batch * a / t
        core = heads * 2 * gemm_time(s, s_kv, h / a, g, ab)
        core += eff.memory_time(heads * s * s_kv * 9, g)  # softmax in/out, mask, dropout in/out (bytes)
        return core, 2.0 * core
    # fused causal SDPA: half the score matrix is computed; backward 2.5x (FlashAttention-2)
    attn_flops = 4 * tok * s_kv * h / t / 2
    rates = g.calibration.attention_rates(s_kv, h / a) if g.calibration is not None else None
    if rates is not None:
        return eff.scale_attention((attn_flops / rates[0], 2.5 * attn_flops / rates[1]), g)
    kv = h if model.mla else model.n_kv_heads * model.head_dim
    io = tok * ab * (2 * h + 2 * kv * s_kv / s) / t  # q and o per query token, k and v per key token
    return eff.attention_time(attn_flops, s_kv, h / a, io, peak_flops(g, ab), g)


def _elementwise_time(model: ModelConfig, L: Layout, work: Workload, g: GPUSpec, tok: int, f_inner: float,
                      routing: float) -> tuple[float, float]:
    """(forward, backward) seconds of the block's element-wise kernels (memory-bound passes plus
    their launches)."""
    ab, t, h = work.act_bytes, L.tp, model.dim
    q, kv = h, model.n_kv_heads * model.head_dim
    sp = t if L.sequence_parallel else 1
    if work.style is BlockStyle.MEGATRON:  # Megatron-LM's fused kernels: one pass per norm, bias-GELU, dropout-add
        elem = eff.memory_time(tok * ab * (14 * h / sp + 6 * (q + kv) / t + 4 * f_inner / t), g)
        return elem, 2 * elem
    # this runtime's block: eager, every op reads its inputs and writes its output; compiled, fused
    compiled = work.style is BlockStyle.COMPILED
    widths = (h / sp, q / t, kv / t, f_inner / t)
    fwd_b, bwd_b = ((ab * x for x in fused_elementwise_elements(*widths)) if compiled
                    else eager_elementwise_bytes(*widths, ab, work.param_bytes))
    kernels = COMPILED_KERNELS if compiled else EAGER_KERNELS
    cal = g.calibration
    fixed = cal.block if cal is not None and cal.block else (kernels[0] * g.launch_overhead,
                                                             kernels[1] * g.launch_overhead)
    return (eff.memory_time(tok * (fwd_b + ab * routing), g) + eff.fixed_time(fixed[0], g),
            eff.memory_time(tok * (bwd_b + 1.5 * ab * routing), g) + eff.fixed_time(fixed[1], g))


def _host_floors(work: Workload, counted: list[tuple[float, float, float, float]], g: GPUSpec) -> tuple[float, float]:
    """(forward, backward) seconds the host needs to issue one layer's kernels (its GEMMs, the
    attention kernel and the element-wise kernels; backward: two GEMMs per forward GEMM and the
    attention's backward), the launch floor of :func:`hybridpar.planner.machine.efficiency.host_floor`.
    Megatron-LM's fused block is not host-bound at the sizes it is used for: none."""
    if work.style is BlockStyle.MEGATRON:
        return 0.0, 0.0
    compiled = work.style is BlockStyle.COMPILED
    kernels = COMPILED_KERNELS if compiled else EAGER_KERNELS
    gemms = sum(c for c, *_ in counted)
    return (eff.host_floor(gemms + 1 + kernels[0], g, compiled),
            eff.host_floor(2 * gemms + 1 + kernels[1], g, compiled))


def _tp_cp_comm(model: ModelConfig, L: Layout, work: Workload, cluster: Cluster, tok: int) -> tuple[float, float, float]:
    """Seconds of the block's tensor-parallel collectives per entry/exit pair, of its exit
    collective alone, and of one ring-attention pass of K/V over cp."""
    t, h, ab = L.tp, model.dim, work.act_bytes
    if L.sequence_parallel:  # all-gather of the sequence shard, reduce-scatter of the full output
        exit_comm = cluster.collective_time("reduce_scatter", tok * h * ab, t, 1)
        ar = cluster.collective_time("all_gather", tok * h * ab / t, t, 1) + exit_comm
    else:
        ar = exit_comm = cluster.collective_time("all_reduce", tok * h * ab, t, 1)
    return ar, exit_comm, cp_times(model, L, work, cluster)[0]


def layer_time(model: ModelConfig, layout: Layout, work: Workload, cluster: Cluster,
               moe: bool = False) -> LayerTime:
    """Compute and tp communication of one decoder layer (the block ``work.style`` names) for
    one micro-batch (see module doc). ``moe``: an MoE layer (:func:`_moe_ffn` replaces the MLP;
    the all-to-alls, two forward and two backward, are on the critical path)."""
    g, ab, L = cluster.rank_gpu, work.act_bytes, layout
    megatron = work.style is BlockStyle.MEGATRON
    s = work.seq_len // L.cp
    tok = L.micro_batch * s
    gemms, counted, f_inner, routing, a2a = _block_gemms(model, L, work, cluster, tok, moe)
    fwd_gemm = sum(c * gemm_time(m, n, k, g, ab) for c, m, n, k in counted)
    bwd_in, bwd_w = (sum(x) for x in zip(*((c * i, c * w) for c, m, n, k in counted
                                          for i, w in [gemm_backward_time(m, n, k, g, ab)]), strict=True))
    if work.fp8 != "none":  # the dense linears (not an MoE layer's experts) in FP8
        dense = gemms[:len(gemms) - (3 if moe and not megatron else 2 if moe else 0)]
        df, di, dw = fp8_gemm_deltas(dense, g, work.fp8, lambda m, n, k: gemm_time(m, n, k, g, ab))
        fwd_gemm, bwd_in, bwd_w = fwd_gemm + df, bwd_in + di, bwd_w + dw
    core, core_b = _attention_core(model, L, work, g, s, tok)
    elem, elem_b = _elementwise_time(model, L, work, g, tok, f_inner, routing)
    ar, exit_comm, cp_pass = _tp_cp_comm(model, L, work, cluster, tok)
    hide = overlap_fraction(g)  # ring attention passes K/V while attention computes
    ep_comm = 2 * a2a + (all_to_all_time(cluster, model.n_experts * 8, L.ep, L.tp) if moe else 0.0)  # + counts
    a2a_cp = cp_times(model, L, work, cluster)[1]  # Ulysses all-to-alls: on the critical path
    host_f, host_b = _host_floors(work, counted, g)  # the layer's device time is at least its launches
    cast_f, cast_b = weight_traffic(model, L, work, g)
    elem, elem_b = elem + cast_f, elem_b + cast_b
    exposed = 1.0 - work.ep_overlap  # DualPipe (Workload.ep_overlap) hides the all-to-alls
    f = max(fwd_gemm + core + elem, host_f) + max(0.0, cp_pass - hide * core) + 2 * ar + exposed * ep_comm + a2a_cp
    b_time = (max(bwd_in + core_b + elem_b, host_b) + max(0.0, 2 * cp_pass - hide * core) + 2 * ar
              + exposed * 2 * a2a + a2a_cp)
    # full recompute reruns the block's forward; in this runtime it stops after the last tensor
    # backward needs (torch's checkpoint), skipping the MLP's down projection (an MoE layer's
    # experts all rerun: the last tensor saved is the combine's) and the exit collective
    skip_gemm = 0.0 if megatron or moe else gemm_time(*gemms[-1], g, ab)
    skip_comm = 0.0 if megatron else exit_comm
    tp_comm = 4 * ar
    ep_total = ep_comm + 2 * a2a
    if L.recompute == "full":
        b_time += f - skip_gemm - skip_comm
        tp_comm += 2 * ar - skip_comm
        ep_total += ep_comm
    elif L.recompute == "selective" and work.selective_ac == "op":  # torchtitan's op policy (.sac): every
        # second GEMM, the element-wise work and the forward collectives it keeps no output of
        rerun_comm = 2 * (ar - exit_comm) if L.sequence_parallel and L.tp > 1 else 2 * ar
        b_time += sum(c * gemm_time(m, n, k, g, ab) for c, m, n, k in sac.recomputed_calls(counted)) + elem
        b_time += rerun_comm
        tp_comm += rerun_comm
    elif L.recompute == "selective":
        b_time += core
    f, b_time = offload_layer_times(model, L, work, g.host_bw, f, b_time, moe)  # host copies beyond compute
    return LayerTime(f, b_time, bwd_w, tp_comm, ep_total)


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
    # = simulate(build_schedule(...), Costs(f, b, w, p2p, scale).per_chunk(v)).makespan, compiled
    return pipesim.makespan(pipesim.compile_schedule(kind, pp, v, m), f, b, w, p2p, scale)


def pipeline_makespan(kind: str, pp: int, v: int, m: int, lt: LayerTime, p2p: float,
                      scale: tuple[float, ...]) -> float:
    """Makespan of ``m`` micro-batches through the schedule with stage costs ``lt`` scaled per
    stage; long runs are simulated for ``2 * pp`` micro-batches and extrapolated."""
    cap = 2 * pp
    if m <= cap:
        return _makespan(kind, pp, v, m, lt.f, lt.b, lt.w, p2p, scale)
    base = _makespan(kind, pp, v, cap, lt.f, lt.b, lt.w, p2p, scale)
    per_rank = [sum(scale[s] for s in rank_stages(r, pp, v, v_shaped(kind))) / v for r in range(pp)]
    return base + (m - cap) * max(per_rank) * (lt.f + lt.b + lt.w)


def pipeline_lower_bound(kind: str, pp: int, v: int, m: int, lt: LayerTime, p2p: float,
                         scale: tuple[float, ...]) -> float:
    """A closed-form lower bound of :func:`pipeline_makespan` (:func:`hybridpar.planner.price.pipesim.lower_bound`)."""
    return pipesim.lower_bound(kind, pp, v, m, lt.f, lt.b, lt.w, p2p, scale)


# The Layout fields layer_time never reads (nor what it calls): candidates differing only in them
# share one layer's price (the schedule matters to activation offload's zero-bubble split only)
_UNPRICED = dict(zero_stage=0, dp_shard=0, offload_optimizer=False, offload_to="cpu", offload_params=False,
                 grad_compression="none")
_LAYERS: IdentityMemo[LayerTime] = IdentityMemo(65536)
# the other fields, read in one C call: the memo's key (the shape priced is built on a miss only)
_PRICED = operator.attrgetter(*(f.name for f in dataclasses.fields(Layout)
                                if f.name not in _UNPRICED and f.name != "pipeline_schedule"))


def priced_layer(model: ModelConfig, L: Layout, work: Workload, cluster: Cluster, moe: bool = False) -> LayerTime:
    """:func:`layer_time`, memoised per cluster, model shape and the layout fields it reads."""
    fields = _UNPRICED if L.offload_activations else {**_UNPRICED, "pipeline_schedule": "1f1b"}
    sched = L.pipeline_schedule if L.offload_activations else "1f1b"
    return _LAYERS.get(cluster, (model_key(model), _PRICED(L), sched, work, moe),
                       lambda: layer_time(model, dataclasses.replace(L, **fields), work, cluster, moe=moe))  # type: ignore[arg-type]


def _mean_layer(lts: dict[bool, LayerTime], n_moe: int, n_layers: int) -> LayerTime:
    """The mean layer of a model with ``n_moe`` MoE layers (``lts[True]``) among ``n_layers``."""
    if len(lts) == 1:
        return next(iter(lts.values()))
    wm = n_moe / n_layers
    return LayerTime(*(wm * getattr(lts[True], f) + (1 - wm) * getattr(lts[False], f)
                       for f in ("f", "b", "w", "tp_comm", "ep_comm")))


def _stage_scale(model: ModelConfig, L: Layout, work: Workload, cluster: Cluster, lts: dict[bool, LayerTime],
                 lt: LayerTime, tok: int) -> tuple[float, ...]:
    """Each pipeline chunk's cost (its layers, the head's and the embedding's work) relative to a
    chunk of the mean layer ``lt``, over the runtime's partition."""
    g, ab, t, pp, v = cluster.rank_gpu, work.act_bytes, L.tp, L.pp, L.virtual_stages
    moe_ids = set(model.moe_layer_ids())
    vocab = padded(model.vocab_size, t) / t
    head_f = gemm_time(tok, vocab, model.dim, g, ab) + eff.memory_time(3 * tok * vocab * (ab + 4), g)
    emb_f = cluster.collective_time("all_reduce", tok * model.dim * ab, t, 1)  # vocab-parallel embedding
    part = layer_partition(model_key(model), pp, v, pp > 1 and v_shaped(L.pipeline_schedule))  # the runtime's, cached
    stage_cost = []
    for c in part.chunks:
        cost = sum(lts[i in moe_ids].f + lts[i in moe_ids].b + lts[i in moe_ids].w for i in c.layers)
        cost += (3 * head_f if c.head else 0.0) + (2 * emb_f if c.embedding else 0.0)
        stage_cost.append(cost)
    unit = model.n_layers / (pp * v) * (lt.f + lt.b + lt.w)
    return tuple(round(x / unit, 6) for x in stage_cost)


def _pipeline_span(model: ModelConfig, L: Layout, work: Workload, cluster: Cluster, m: int, stage_lt: LayerTime,
                   scale: tuple[float, ...], bound_only: bool) -> tuple[float, float, float]:
    """(makespan of the step's ``m`` micro-batches, the busiest rank's compute, one p2p message)."""
    pp, v, t = L.pp, L.virtual_stages, L.tp
    tok = L.micro_batch * (work.seq_len // L.cp)
    vs = pp > 1 and v_shaped(L.pipeline_schedule)
    p2p = 0.0
    if pp > 1:
        p2p = cluster.collective_time("send", tok * model.dim * work.act_bytes / (t if L.sequence_parallel else 1),
                                      pp, t * L.cp * L.dp)
        kind = L.pipeline_schedule
        span = (pipeline_lower_bound if bound_only else pipeline_makespan)(kind, pp, v, m, stage_lt, p2p, scale)
    else:
        span = m * (stage_lt.f + stage_lt.b + stage_lt.w) * scale[0]
    busy = m * max(sum(scale[s] for s in rank_stages(r, pp, v, vs)) / v for r in range(pp)) * (
        stage_lt.f + stage_lt.b + stage_lt.w)
    return span, busy, p2p


_SPANS: IdentityMemo[tuple[tuple[float, ...], float, float, float]] = IdentityMemo(65536)


def _scale_and_span(model: ModelConfig, L: Layout, work: Workload, cluster: Cluster, m: int, lts: dict[bool, LayerTime],
                    lt: LayerTime, stage_lt: LayerTime, tok: int, bound_only: bool) -> tuple[tuple[float, ...], float, float, float]:
    """(:func:`_stage_scale`, then :func:`_pipeline_span`'s makespan, busiest compute, p2p)."""
    scale = _stage_scale(model, L, work, cluster, lts, lt, tok)
    return (scale, *_pipeline_span(model, L, work, cluster, m, stage_lt, scale, bound_only))


def step_cost(model: ModelConfig, layout: Layout, work: Workload, cluster: Cluster, *,
              bound_only: bool = False) -> CostReport:
    """Predicted time of one optimizer step and its terms (see the module docstring).
    ``bound_only``: skip the schedule simulation and take :func:`pipeline_lower_bound` as the
    makespan: a lower bound of the step time (the search prunes with it)."""
    L, v = layout, layout.virtual_stages
    m = L.microbatches(work.global_batch)
    tok = L.micro_batch * (work.seq_len // L.cp)
    moe_ids = set(model.moe_layer_ids())
    lts = {moe: priced_layer(model, L, work, cluster, moe) for moe in {i in moe_ids for i in range(model.n_layers)}}
    lt = _mean_layer(lts, len(moe_ids), model.n_layers)
    per_stage_layers = model.n_layers / (L.pp * v)
    stage_lt = LayerTime(lt.f * per_stage_layers * v, lt.b * per_stage_layers * v,
                         lt.w * per_stage_layers * v, 0.0)
    # the stage scales and the schedule's span read only these fields (not ZeRO, offload, recompute
    # but through the layer times): candidates differing in the others share them
    key = (model_key(model), L.dp, L.tp, L.pp, L.cp, v, L.pipeline_schedule, L.micro_batch, L.sequence_parallel,
           work, m, tuple(sorted(lts.items())), bound_only)
    scale, span, busy, p2p = _SPANS.get(cluster, key, lambda: _scale_and_span(
        model, L, work, cluster, m, lts, lt, stage_lt, tok, bound_only))
    gr = gradients(model, L, work, cluster.rank_gpu)
    dp_comm, dp_exposed = dp_time(model, L, work, cluster, gr, m, stage_lt, scale, overlap_fraction(cluster.rank_gpu))
    opt = optimizer_time(model, L, work, cluster.rank_gpu, gr.worst, m)
    clip = clip_time(model, L, cluster.rank_gpu)
    step = span + dp_exposed + opt + gr.quantize + clip
    flops = model_flops(model, work)
    hw = flops + recompute_flops(model, L, work)
    world = L.world_size
    terms = {"pipeline_makespan": span, "compute_busy": busy, "bubble": max(0.0, span - busy),
             "tp_comm": m * lt.tp_comm * per_stage_layers * v, "pp_p2p_per_message": p2p,
             **({"ep_all_to_all": m * lt.ep_comm * per_stage_layers * v} if moe_ids else {}),
             "dp_comm": dp_comm, "dp_exposed": dp_exposed, "optimizer": opt, "grad_clip": clip, "quantize": gr.quantize,
             "layer_fwd": lt.f, "layer_bwd": lt.b + lt.w}
    return CostReport(step_time_s=step, mfu=flops / (step * world * cluster.gpu.bf16_flops),
                      tflops_per_gpu=flops / (step * world) / 1e12,
                      hw_tflops_per_gpu=hw / (step * world) / 1e12,
                      tokens_per_s=work.global_batch * work.seq_len / step, terms=terms,
                      bubble_fraction=max(0.0, span - busy) / span if span > 0 else 0.0)
