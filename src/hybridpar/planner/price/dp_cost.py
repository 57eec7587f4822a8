"""The data-parallel and optimizer terms of a step's predicted time (:func:`hybridpar.planner.price.cost.step_cost`):
the busiest pipeline rank's gradient bytes, their bucketed all-reduces or ZeRO-3's gathers and
reduce-scatters over dp x cp (the routed experts' over edp), what backward leaves exposed, and
the optimizer step on the rank's shard, on the device or offloaded."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridpar.config import ModelConfig
from hybridpar.planner.machine import efficiency
from hybridpar.planner.machine.hardware import Cluster, GPUSpec
from hybridpar.planner.memory.plan import rank_state_numels
from hybridpar.planner.model.hsdp import collective_seconds, expert_group, hsdp, zero_group
from hybridpar.planner.model.layout import BlockStyle, Layout, Workload, model_key
from hybridpar.planner.model.shapes import rank_numel, v_shaped
from hybridpar.planner.price.fp8 import FP8_LINEARS
from hybridpar.rules import fp8_gathers

if TYPE_CHECKING:
    from hybridpar.planner.price.cost import LayerTime


@dataclass(frozen=True)
class Gradients:
    """What the busiest pipeline rank's data-parallel reduction moves (bytes) and quantises."""

    worst: int  # the pipeline rank with the most parameters
    expert_bytes: int  # its routed experts' gradients (reduced over edp) with ep > 1, else 0
    param_total: int  # its dense parameters' bytes
    reduced: float  # the bytes their reduction carries (compressed or not)
    grad_bytes: float  # the all-reduce-equivalent bytes of a ZeRO-0/1/2 step
    quantize: float  # seconds of int8 quantisation
    gathered: float = 0.0  # ZeRO-3: the dense bytes one full gather carries (FP8 weights at 1 byte with fp8_all_gather)
    fp8_weights: int = 0  # ZeRO-3 with fp8_all_gather: the FP8 linear weights gathered (one amax all-reduce float each)


def gradients(model: ModelConfig, L: Layout, work: Workload, g: GPUSpec) -> Gradients:
    """The data-parallel gradient bytes over dp x cp (stride tp) of the busiest pipeline rank."""
    t, pp, v = L.tp, L.pp, L.virtual_stages
    vs = pp > 1 and v_shaped(L.pipeline_schedule)
    key = model_key(model)  # the pipeline rank with the most parameters, its count cached
    worst = max(range(pp), key=lambda r: rank_numel(key, t, pp, v, r, 1, L.ep, v_shape=vs))
    # with ep > 1 the routed experts reduce over edp (dp x cp / ep ranks, stride tp x ep) instead
    expert_bytes = rank_numel(key, t, pp, v, worst, 1, L.ep, "experts", vs) * work.param_bytes if L.ep > 1 else 0
    grad_numel = rank_numel(key, t, pp, v, worst, 1, L.ep, v_shape=vs) - expert_bytes // work.param_bytes  # dense
    param_total = grad_bytes = reduced = grad_numel * work.param_bytes
    quantize = 0.0
    if L.grad_compression == "int8":  # 1 + 4/256 bytes per element; every rank quantises its
        # gradient (read it and the residual, write int8 and the residual), dequantises n blocks
        reduced = grad_numel * (1 + 4 / 256)
        quantize = grad_numel * (4 + 4 + 1 + 4 + 2 * 4) / g.hbm_bw
    elif L.grad_compression in ("bf16", "fp16"):
        reduced = grad_numel * 2
    if reduced != param_total:  # all-reduce-equivalent bytes: ZeRO-0 compresses both halves,
        # ZeRO-1/2 the reduce-scatter half (the parameter all-gather keeps the parameter dtype)
        grad_bytes = reduced if L.zero_stage == 0 else (reduced + param_total) / 2
    gathered, weights = param_total, 0
    if fp8_gathers(work.fp8, work.fp8_all_gather, L.zero_stage):  # FP8 linears' weights gathered at 1 byte
        gathered -= rank_numel(key, t, pp, v, worst, 1, L.ep, "fp8", vs) * (work.param_bytes - 1)
        weights = len(FP8_LINEARS) * model.n_layers // pp
    return Gradients(worst, expert_bytes, param_total, reduced, grad_bytes, quantize, gathered, weights)


def bucketed_comm(L: Layout, work: Workload, cluster: Cluster, gr: Gradients) -> tuple[float, float]:
    """(seconds of ZeRO-0/1/2's gradient all-reduces, of the last bucket's alone): buckets of
    ``bucket_mb``, the last filling when backward ends; experts' buckets over edp."""
    n, t = L.dp * L.cp, L.tp
    buckets = max(1, math.ceil(gr.grad_bytes / (work.bucket_mb * 2**20)))
    last_bucket = cluster.collective_time("all_reduce", gr.grad_bytes / buckets, n, t)
    if hsdp(L):  # reduce-scatter and all-gather in the ZeRO group, the shard's all-reduce across it
        last_bucket = sum(collective_seconds(cluster.collective_time, L, gr.reduced / buckets, gr.param_total / buckets))
    dp_comm = buckets * last_bucket
    if gr.expert_bytes and n // L.ep > 1:
        expert_buckets = max(1, math.ceil(gr.expert_bytes / (work.bucket_mb * 2**20)))
        dp_comm += expert_buckets * cluster.collective_time("all_reduce", gr.expert_bytes / expert_buckets,
                                                            n // L.ep, t * L.ep)
    return dp_comm, last_bucket


def zero3_comm(model: ModelConfig, L: Layout, cluster: Cluster, gr: Gradients, m: int,
               stage_lt: LayerTime, hide: float) -> tuple[float, float, float]:
    """(ZeRO-3's data-parallel seconds per step, the part of them prefetching leaves exposed, the
    last unit's reduce-scatter, which nothing follows to hide it)."""
    (_, n, replicas), t, v = zero_group(L), L.tp, L.virtual_stages  # HSDP: the ZeRO group, then its replicas
    if L.pp > 1:
        # under pp (hybridpar.parallel.zero.zero3_pp.StageSharded) each of the rank's v chunks is gathered once
        # per step, before its first forward, and reduce-scattered once after its last backward
        amax = cluster.collective_time("all_reduce", 4 * gr.fp8_weights / v, n, t) if gr.fp8_weights else 0.0
        return v * (cluster.collective_time("all_gather", gr.gathered / v / n, n, t) + amax
                    + cluster.collective_time("reduce_scatter", gr.reduced / v, n, t)
                    + cluster.collective_time("all_reduce", gr.reduced / v / n, replicas, t * n)), 0.0, 0.0
    # one all-gather per unit (each block, the embedding, the root) forward and backward, one
    # reduce-scatter per unit per step; each call pays its latency (hybridpar.parallel.zero.zero3).
    # The runtime prefetches the next unit's gather only on GPUs (the Engine: on CPU the
    # collective would run on the same cores), so on a CPU profile nothing hides them.
    units = model.n_layers + (1 if model.tie_embeddings else 2)
    gather = units * cluster.collective_time("all_gather", gr.gathered / units / n, n, t)
    if gr.fp8_weights:  # fp8_all_gather: each block's gather after an all-reduce of its weights' amaxes
        gather += model.n_layers * cluster.collective_time("all_reduce", 4 * gr.fp8_weights / model.n_layers, n, t)
    edp, e_units = expert_group(L)[1], len(set(model.moe_layer_ids()))
    if gr.expert_bytes and edp > 1:  # each MoE layer's experts: a unit of their own over edp
        gather += e_units * cluster.collective_time("all_gather", gr.expert_bytes / e_units / edp, edp, t * L.ep)
    cal = cluster.rank_gpu.calibration
    hide_gather = 0.0 if cal is not None and cal.device == "cpu" else hide
    # The units are not equal: the embedding's (vocab x dim) is gathered first in every forward,
    # before any compute exists to hide it, and reduce-scattered last, after backward's compute.
    emb = model.vocab_size * model.dim / model.num_params()
    first = cluster.collective_time("all_gather", gr.gathered * emb / n, n, t)
    forward = first + max(0.0, gather - first - hide_gather * stage_lt.f)
    exposed = m * (forward + max(0.0, gather - hide_gather * stage_lt.b))

    def scatter(nbytes: float) -> float:
        return (cluster.collective_time("reduce_scatter", nbytes, n, t)
                + cluster.collective_time("all_reduce", nbytes / n, replicas, t * n))

    dp_comm = units * scatter(gr.reduced / units) + exposed
    if gr.expert_bytes and edp > 1:
        dp_comm += e_units * cluster.collective_time("reduce_scatter", gr.expert_bytes / e_units, edp, t * L.ep)
    return dp_comm, exposed, scatter(gr.reduced * emb)


def dp_time(model: ModelConfig, L: Layout, work: Workload, cluster: Cluster, gr: Gradients, m: int,
            stage_lt: LayerTime, scale: tuple[float, ...], hide: float) -> tuple[float, float]:
    """(data-parallel communication per step, the part of it backward does not hide): ``stage_lt``
    a pipeline stage's times, ``scale`` the stages' relative costs, ``hide`` the fraction of an
    asynchronous collective that compute hides (:func:`hybridpar.planner.price.cost.overlap_fraction`)."""
    dp_comm, last_bucket = bucketed_comm(L, work, cluster, gr)
    last_backward = (stage_lt.b + stage_lt.w) / L.virtual_stages * max(scale)
    exposed_z3 = 0.0  # ZeRO-3's gather time prefetching leaves exposed: not hidden again by backward
    floor = last_bucket  # the last bucket (ZeRO-3: unit) is reduced after backward's last compute
    if L.zero_stage == 3:
        dp_comm, exposed_z3, floor = zero3_comm(model, L, cluster, gr, m, stage_lt, hide)
    copies = zero3_copy_time(L, gr, m, cluster.rank_gpu) if L.zero_stage == 3 else 0.0
    if L.pp > 1:
        return dp_comm, dp_comm + copies
    return dp_comm, exposed_z3 + copies + max(floor, dp_comm - exposed_z3 - hide * last_backward)


def zero3_copy_time(L: Layout, gr: Gradients, m: int, g: GPUSpec) -> float:
    """Seconds of ZeRO-3's copies between its flat collective buffers and the tensors, which run
    beside compute (not hidden like the collectives): every gather unpacks the gathered buffer
    into the unit's parameters (reads and writes their bytes; ``ShardLayout.unpack`` in
    :mod:`hybridpar.parallel.zero.shard`, FSDP2's ``foreach_all_gather_copy_out``), and every
    reduce-scatter packs the unit's full gradients into its send buffer in the reduce dtype
    (``ShardLayout.pack``; FSDP2's ``chunk_cat``). Without pp: a gather before each micro-batch's
    forward and again before its backward; under pp, one per chunk and step."""
    gathers = 1 if L.pp > 1 else 2 * m
    return efficiency.memory_time(2 * gathers * gr.param_total + gr.param_total + gr.reduced, g)


# Bytes per parameter one AdamW step moves. Megatron-LM's fused Adam (apex ``FusedAdam``) is one
# pass: read p, g, m, v (and the fp32 master with half parameters), write p, m, v (and master):
# ``2 * param_bytes + 28``. torch's AdamW, which this runtime and torchtitan step with (foreach on
# CUDA, a per-tensor loop on CPU: the same kernels), runs eight passes over fp32 state
# (torch/optim/adam.py ``_multi_tensor_adam``): ``mul_`` (weight decay, 8 bytes), ``lerp_`` (m, 12),
# ``mul_`` (v, 8), ``addcmul_`` (v, reading the gradient as both factors, 16), ``sqrt`` (8), ``div_``
# (8), ``add_`` (eps, 8), ``addcdiv_`` (p, 16): 84 bytes, as benchmarks/planner_kernels.py counts them.
FOREACH_ADAMW_BYTES = 84


def optimizer_time(model: ModelConfig, L: Layout, work: Workload, g: GPUSpec, worst: int, m: int) -> float:
    """Seconds of the optimizer step on the busiest rank's shard (offloaded: host memory and disk)."""
    shard = rank_state_numels(model_key(model), L, worst)[1 if L.zero_stage >= 1 else 0]
    per = 2 * work.param_bytes + 28 if work.style is BlockStyle.MEGATRON else FOREACH_ADAMW_BYTES
    opt = shard * per / g.hbm_bw
    if L.offload_optimizer:
        opt = shard * 2 * work.param_bytes / g.host_bw + shard * 28 / 100e9  # + host Adam at ~100 GB/s DRAM
        if L.offload_to == "disk":  # each group's file read (ahead) and written back: masters, host grads, m, v
            opt += shard * 2 * 16 / g.disk_bw
    if L.offload_params and L.zero_stage == 3:  # every gather first brings the shard to the device
        per_step = (1 if L.pp > 1 else 2 * m) * shard * work.param_bytes  # pp: one gather per chunk and step
        opt += per_step / g.host_bw + (per_step * 4 / work.param_bytes + shard * 4) / g.disk_bw * (
            L.offload_to == "disk")  # from the file (fp32), and written back after the step
    return opt
