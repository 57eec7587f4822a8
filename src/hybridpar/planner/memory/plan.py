"""Per-rank device memory of a layout, by component, for the worst pipeline stage.

Model states come from the exact parameter shapes each rank holds (the same tensor-parallel
split, vocabulary padding and pipeline partition the runtime uses), so for layouts the runtime
runs they equal its live tensor bytes. Bytes per parameter (P = parameters on the rank, N = dp x cp):

* fp32 parameters (fp32 runs, and this runtime's autocast): 4 param + 4 grad + 8 Adam (m, v);
* half parameters (Megatron-LM / DeepSpeed mixed precision): 2 + 2 + 12 (fp32 master, m, v).

ZeRO (Rajbhandari et al. 2020): stage 1 shards the optimizer state over dp x cp (the runtime's ZeRO axis), stage 2 also the
gradients, stage 3 also the parameters; each parameter is split along dim 0 into ``ceil(rows/N)``
row blocks (:mod:`hybridpar.parallel.zero.shard`), so the worst rank holds the rounded-up block.
ZeRO-3 under pipeline parallelism gathers each chunk once per step and keeps it until its last
backward, gradients accumulating unsharded (:class:`hybridpar.parallel.zero.zero3_pp.StageSharded`): at
the peak, before the first chunk is released, the rank holds its shards plus the full parameters
and gradients of all its chunks. ZeRO-2 and ZeRO-3 save gradient memory only with one micro-batch
per step: with gradient accumulation (or ZeRO-2 under pp) the micro-batches but the last run in
``no_sync`` and their full gradients add up locally, as FSDP's ``no_sync``, so at the peak the rank
holds the full gradients and the shard they are reduce-scattered into (``tests/test_zero.py``
measures it).
Offload moves the optimizer state, with the fp32 masters and host gradient copy it keeps, to
host memory (reported as ``cpu_gib``), or with ``offload_to = "disk"`` to files (``disk_gib``,
resident only while a group updates); ``offload_params`` moves the ZeRO-3 shards there too. int8 gradient
compression adds its fp32 error-feedback residuals (4 bytes per gradient element) to ``grads``.

Activations per layer come from :mod:`hybridpar.planner.memory.activations` (the block style's formulas); activation
offload (``parallel.offload_activations``) takes its layers' off the device, and puts them in
host memory (``cpu_gib``), as :mod:`hybridpar.planner.memory.offload` says.

Per micro-batch and pipeline chunk come the embedding's token ids (int64, plus a mask under tp),
the fp32 RoPE tables, under autocast a half copy of every matmul weight (autocast caches casts per
forward, and autograd keeps them; FP8 linears keep theirs quantized, ``fp8.recipe``; under full
recompute autograd keeps none: the chunk's casts live only during its forward, and the recomputed
layer's own during its backward, :func:`recompute_transient`), on non-last pipeline chunks the output the runner holds until
the backward, and on the last the final norm and the fp32 softmax of the loss (``4 V/t``; the
logits themselves are not kept), or with the chunked loss (``train.loss_chunk_tokens``) 18 bytes
per token instead (:data:`CHUNKED_LOSS_TOKEN_BYTES`; a chunk's logits are transient). The
``logits`` component also holds what the unchunked loss's backward adds at its peak
(:func:`hybridpar.planner.memory.activations.loss_backward_bytes`), the step's peak on the rank with the head; a
single-rank ZeRO-0 step of one micro-batch has no gradients yet at that moment
(:func:`gradients_dropped`). How many (micro-batch, chunk) sets a rank holds at once comes
from the schedule's own compute order (:func:`live_chunk_counts`): the interleaving factor, GPipe
keeping every micro-batch (and its softmax) on the last stage, ZB-H1 freeing a chunk's activations
at B but keeping, until W, what its deferred weight gradients need (:func:`deferred_layer_bytes`).

Mixture of experts (:mod:`hybridpar.planner.model.moe`): the routed experts' states are a ZeRO group of their own over
``edp = dp x cp / ep`` (:func:`rank_state_numels`); an MoE layer's activations replace the dense
MLP's with :func:`moe_ffn_bytes` at the busiest ep rank's load; the all-to-all's send and receive
buffers are comm buffers. Those alive only inside a layer (the dispatch's, ZeRO-3's gathered
layers, ring attention's blocks) are not there at the loss's backward, the peak of the rank with
the head (:class:`hybridpar.planner.memory.comm.CommBuffers`).

Allowance (``overhead``, stated, not fitted: :mod:`hybridpar.planner.machine.allocator`): the CUDA context, cuBLAS
workspaces, one NCCL communicator's buffers per mesh axis with peers, and the caching allocator's
fragmentation of the activations it frees and re-allocates every micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

from hybridpar.config import ModelConfig
from hybridpar.parallel.pipeline.partition import ChunkSpec
from hybridpar.planner.machine.allocator import communicators, gpu_overhead
from hybridpar.planner.machine.hardware import GiB
from hybridpar.planner.memory.activations import (
    CHUNKED_LOSS_TOKEN_BYTES,
    deferred_layer_bytes,
    layer_activation_bytes,
    layer_weight_cast_bytes,
    loss_backward_bytes,
    loss_chunked,
    mtp_activation_bytes,
)
from hybridpar.planner.memory.activations import _loss_bytes as _loss_bytes
from hybridpar.planner.memory.activations import gpt_layer_bytes as gpt_layer_bytes
from hybridpar.planner.memory.activations import korthikanti_layer_bytes as korthikanti_layer_bytes
from hybridpar.planner.memory.activations import llama_layer_bytes as llama_layer_bytes
from hybridpar.planner.memory.activations import moe_ffn_bytes as moe_ffn_bytes
from hybridpar.planner.memory.comm import CommBuffers, comm_buffer_bytes
from hybridpar.planner.memory.offload import (
    chunk_offload,
    offload_peak,
)
from hybridpar.planner.memory.peaks import live_chunk_counts, peak_microbatches
from hybridpar.planner.model.hsdp import expert_group, replica_residual_bytes, zero_group
from hybridpar.planner.model.layout import (
    BlockStyle,
    Layout,
    ModelKey,
    Workload,
    model_key,
    model_of,
)
from hybridpar.planner.model.shapes import (
    layer_partition,
    numel,
    padded,
    rank_numel,
    v_shaped,
)

COMPONENTS = ("params", "grads", "optimizer", "activations", "logits", "comm_buffers", "overhead")


@dataclass(frozen=True)
class ModelStates:
    """Bytes of parameters, gradients and optimizer state on one rank (device and host)."""

    params: int
    grads: int
    optimizer: int
    cpu_optimizer: int = 0  # offloaded to host memory (optimizer state, and parameter shards)
    disk: int = 0  # offloaded to files (offload_to = "disk")


def _states(full: int, shard: int, zero_stage: int, param_bytes: int, offload: bool,
            offload_to: str = "cpu", offload_params: bool = False, pipelined: bool = False,
            accumulates: bool = False) -> ModelStates:
    opt_per = 8 if param_bytes == 4 else 12  # Adam m, v (+ fp32 master with half params)
    params = param_bytes * (shard if zero_stage >= 3 else full)
    grads = param_bytes * (shard if zero_stage >= 2 else full)
    opt = opt_per * (shard if zero_stage >= 1 else full)
    if zero_stage == 3 and pipelined:  # ZeRO-3 x pp at its peak (before the first chunk's release):
        params += param_bytes * full  # the rank's chunks gathered for the whole step,
        grads = param_bytes * full  # their gradients accumulated unsharded over the micro-batches
    elif zero_stage >= 2 and (accumulates or pipelined):  # no_sync: full gradients add up locally over
        grads = param_bytes * (full + shard)  # the micro-batches; the last one reduce-scatters them into the shard
    if not offload:
        return ModelStates(params, grads, opt, 0)
    # offload keeps fp32 masters and a host gradient copy with the state (parallel/zero/stages.py)
    host = opt + (0 if param_bytes == 2 else 4 * shard) + 4 * shard
    moved = param_bytes * shard if offload_params and zero_stage == 3 else 0  # the shards, off the device
    if offload_to == "disk":
        return ModelStates(params - moved, grads, 0, 0, host + moved)
    return ModelStates(params - moved, grads, 0, host + moved)


def model_state_bytes(shapes: list[tuple[int, ...]], dp: int, zero_stage: int, param_bytes: int,
                      offload: bool = False, accumulates: bool = False) -> ModelStates:
    """Parameter, gradient and optimizer bytes of one rank holding ``shapes`` (see module doc);
    ``accumulates``: more than one micro-batch per step."""
    return _states(numel(shapes), numel(shapes, dp), zero_stage, param_bytes, offload, accumulates=accumulates)


# ----------------------------------------------------------------------------- activations per chunk (layers: .activations)


@dataclass(frozen=True)
class ChunkBytes:
    """What one micro-batch of one pipeline chunk keeps: ``body`` from its forward to its
    (input-gradient) backward B (layers, ids, RoPE tables, weight casts, the held output),
    ``head`` (last chunk: final norm and loss), ``deferred`` (what ZB-H1 keeps from B to W)."""

    body: float
    head: float = 0.0
    deferred: float = 0.0
    casts: float = 0.0  # full recompute under autocast: the layers' half weight copies, alive during one forward


def chunk_bytes(model: ModelConfig, layout: Layout, work: Workload, chunk: ChunkSpec) -> ChunkBytes:
    """Activation bytes of one micro-batch of ``chunk`` under ``layout`` (module docstring)."""
    t, cp, L = layout.tp, layout.cp, layout
    sp = L.sequence_parallel and t > 1
    shard = t if sp else 1
    s, b, h = work.seq_len // cp, L.micro_batch, model.dim
    tok, a, r = s * b, work.act_bytes, work.param_bytes
    vocab = padded(model.vocab_size, t) // t
    n = len(chunk.layers)
    moe_ids = set(model.moe_layer_ids())
    n_moe = sum(i in moe_ids for i in chunk.layers)
    layers = ((n - n_moe) * layer_activation_bytes(model, L, work)
              + (n_moe * layer_activation_bytes(model, L, work, moe=True) if n_moe else 0.0))
    if work.style is BlockStyle.MEGATRON:
        # Korthikanti 4.3: embedding output; final norm and head input, fp32 logits
        body = layers + (tok * h * a / shard if chunk.embedding else 0.0)
        logits = tok * (CHUNKED_LOSS_TOKEN_BYTES if loss_chunked(work, tok) else vocab * (a + 4))
        head = 2 * tok * h * a / shard + logits if chunk.head else 0.0
        return ChunkBytes(body, head, body + head)  # not modelled in detail: all of it until W
    autocast = a != r
    rope = model.qk_rope_head_dim if model.mla else model.head_dim
    body = layers + (2 * s * rope * 4 if n else 0)  # RoPE cos and sin
    casts = sum(layer_weight_cast_bytes(model, i, t, L.ep, a, work.fp8) for i in chunk.layers) if autocast else 0.0
    if L.recompute != "full":  # half copies of the layers' matmul weights, kept for backward
        body, casts = body + casts, 0.0  # (a checkpointed block's are not: autocast's cache drops them)
    if chunk.embedding:  # token ids (int64), and under tp the out-of-shard mask
        body += tok * (9 if t > 1 else 8)
    held = tok * h * r / shard  # a hidden state crossing a stage boundary
    if L.pp > 1 and not chunk.head:
        body += held  # the output the runner keeps for backward
    if L.pp > 1 and not chunk.embedding and r < 4:
        body += held  # the received input (with r = 4 it is the first norm's saved fp32 input)
    head = 0.0
    if chunk.head:
        head = tok * (((4 + r) * h + 4) / shard + a * h)  # final norm
        head += 4 if L.pp > 1 else 0  # the runner keeps the scaled loss
        head += _loss_bytes(work, tok, t, vocab)
        head += mtp_activation_bytes(model, L, work) if model.mtp_layers else 0.0
        if autocast or loss_chunked(work, tok):
            head += a * vocab * h  # the head weight's cast (the chunked loss copies it in fp32 too)
    inputs, grads = deferred_layer_bytes(model, t, a, r)
    deferred = n * tok * (inputs + grads)
    if autocast:  # the half weight copies the deferred linears' weight-gradient nodes keep
        q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
        deferred += n * a * (2 * h * q + 2 * h * kv + 3 * h * model.ffn_hidden) / t
    if chunk.head and not model.tie_embeddings and not loss_chunked(work, tok):
        # the head's input and the logits' gradient (a chunked head's weight gradient is not deferred)
        deferred += tok * a * (h + vocab) + (a * vocab * h if autocast else 0)
    if L.recompute == "full" and L.pipeline_schedule in ("zb-h1", "zbv"):
        body += n * tok * inputs  # the deferred linears' inputs are saved at F, not recomputed
    return ChunkBytes(body, head, deferred, casts)


# ----------------------------------------------------------------------------- the whole rank


@dataclass
class MemoryReport:
    """Bytes of the worst pipeline rank by component (``COMPONENTS``), and where it is."""

    components: dict[str, float]
    worst_rank: int
    cpu_bytes: float = 0.0
    in_flight: int = 1  # micro-batch chunks alive on the worst rank
    disk_bytes: float = 0.0  # offload_to = "disk": in files, resident only while in use
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.components.values())

    def gib(self) -> dict[str, float]:
        out = {k: round(v / GiB, 3) for k, v in self.components.items()}
        out["total"] = round(self.total / GiB, 3)
        return out


def rank_activations(model: ModelConfig, layout: Layout, work: Workload,
                     pp_rank: int) -> tuple[float, float, int]:
    """``(activations, logits, chunks in flight)`` of pipeline rank ``pp_rank`` at its peak:
    the heaviest :func:`live_chunk_counts` vector weighted by :func:`chunk_bytes`. (The ZeRO
    stage and offload change none of it: cached without them.) Saved tensors only: the rank's
    peak adds the recomputed backward's weight gradient (:func:`recompute_transient`)."""
    return _rank_activations(model_key(model), _activation_fields(layout), work, pp_rank)


def _activation_fields(L: Layout) -> tuple:
    """The layout fields activations depend on (all but the ZeRO stage and offload)."""
    return (L.dp, L.tp, L.pp, L.cp, L.pipeline_schedule, L.virtual_stages, L.sequence_parallel,
            L.recompute, L.micro_batch, L.ep, L.offload_activations, L.offload_activations_fraction)


@functools.lru_cache(maxsize=65536)
def _rank_activations(key: ModelKey, fields: tuple, work: Workload,
                      pp_rank: int, live: bool = False) -> tuple[float, float, int]:
    dp, tp, pp, cp, sched, v, sp, rec, mb, ep, offload, fraction = fields
    model = model_of(key)
    L = Layout(dp=dp, tp=tp, pp=pp, cp=cp, pipeline_schedule=sched, virtual_stages=v,
               sequence_parallel=sp, recompute=rec, micro_batch=mb, ep=ep, offload_activations=offload,
               offload_activations_fraction=fraction)
    # without pipelining the runtime runs the whole model (virtual stages mean nothing)
    chunks = layer_partition(key, pp, v if pp > 1 else 1, pp > 1 and v_shaped(sched)).for_rank(pp_rank)
    offloads = [chunk_offload(model, L, work, c) for c in chunks]  # parallel.offload_activations (.offload)
    sizes = [ChunkBytes(cb.body - o.saved, cb.head, cb.deferred, cb.casts)
             for cb, o in zip((chunk_bytes(model, L, work, c) for c in chunks), offloads, strict=True)]
    v = len(chunks)
    vectors = live_chunk_counts(L.pipeline_schedule, L.pp, v, L.microbatches(work.global_batch), pp_rank)
    best = (-1.0, 0.0, 0.0, 0)
    for vec in vectors:
        body = sum(n * cb.body + g * cb.deferred for n, g, cb in zip(vec[:v], vec[v:], sizes, strict=True))
        head = sum(n * cb.head for n, cb in zip(vec[:v], sizes, strict=True))
        if body + head > best[0]:
            best = (body + head, body, head, sum(vec[:v]))
    _, acts, logits, in_flight = best
    transient = 0.0
    if L.recompute == "full" or (L.recompute == "selective" and work.selective_ac == "op"):
        transient = recompute_transient(model, L, work, chunks, live)
        freed = max((cb.head for cb in sizes), default=0.0) if work.style is not BlockStyle.MEGATRON else 0.0
        # a forward under autocast holds its chunk's weight casts until it ends; without a
        # pipeline the loss runs after it (the head's tensors are not there yet)
        forward = max(cb.casts for cb in sizes) - (freed if L.pp == 1 else 0.0)
        acts = max(acts, acts - freed + transient, acts + forward)
    if any(o.working for o in offloads):
        acts = max(acts, offload_peak(vectors, sizes, offloads, transient) - logits)
    return acts, logits, in_flight



def recompute_transient(model: ModelConfig, L: Layout, work: Workload, chunks: list[ChunkSpec],
                        live: bool = False) -> float:
    """What the layer being recomputed holds beyond what it stored, until its backward ends: its
    full activations (sharing what it stored); under full recompute with autocast its half
    weight copies, cast again in the recomputation and kept for the backward's matmuls; and with
    ``live`` (what is alive, not only saved) under full recompute the first weight gradient of its backward (the down projection's, fp32, before
    it is added to ``.grad``; the matmul's saved input and weight copy it outlives are freed by
    then, and its input gradient is their size). (The first
    recomputation on a rank with the loss follows that micro-batch's head backward, which has
    freed the head's tensors by then: the caller takes them off.)"""
    a, full = work.act_bytes, L.recompute == "full" and work.style is not BlockStyle.MEGATRON
    cast, grad = full and a != work.param_bytes, full and live
    moe_ids = set(model.moe_layer_ids())
    worst = 0.0
    for moe in {False, bool(moe_ids)}:
        layers = [i for c in chunks for i in c.layers if (i in moe_ids) == moe]
        if not layers and moe:
            continue
        held = (layer_activation_bytes(model, L, work, "none", moe=moe) - layer_activation_bytes(model, L, work, moe=moe)
                + (max(layer_weight_cast_bytes(model, i, L.tp, L.ep, a, work.fp8) for i in layers)
                   if cast and layers else 0.0)
                + (work.param_bytes * model.dim * model.ffn_hidden / L.tp if grad and not moe else 0.0))
        worst = max(worst, held)
    return worst


@functools.lru_cache(maxsize=16384)
def _host_activations(key: ModelKey, fields: tuple, work: Workload, pp_rank: int) -> float:
    """Bytes activation offload holds in host memory on pipeline rank ``pp_rank`` at most: each
    chunk's offloaded layers (:func:`hybridpar.planner.memory.offload.chunk_offload`) times its micro-batches alive."""
    dp, tp, pp, cp, sched, v, sp, rec, mb, ep, offload, fraction = fields
    if not offload:
        return 0.0
    model = model_of(key)
    L = Layout(dp=dp, tp=tp, pp=pp, cp=cp, pipeline_schedule=sched, virtual_stages=v, sequence_parallel=sp,
               recompute=rec, micro_batch=mb, ep=ep, offload_activations=offload, offload_activations_fraction=fraction)
    chunks = layer_partition(key, pp, v if pp > 1 else 1, pp > 1 and v_shaped(sched)).for_rank(pp_rank)
    moved = [chunk_offload(model, L, work, c).moved for c in chunks]
    vectors = live_chunk_counts(sched, pp, len(chunks), L.microbatches(work.global_batch), pp_rank)
    return max(sum(n * b for n, b in zip(vec, moved, strict=False)) for vec in vectors)


def rank_memory(model: ModelConfig, layout: Layout, work: Workload, pp_rank: int) -> MemoryReport:
    """Memory of pipeline rank ``pp_rank`` (see the module docstring for every term)."""
    return _rank_memory(model, model_key(model), layout, work, pp_rank,
                        comm_buffer_bytes(model, layout, work))


def _rank_memory(model: ModelConfig, key: ModelKey, L: Layout, work: Workload, pp_rank: int,
                 comm: CommBuffers, parts: tuple[ModelStates, tuple[float, float, int]] | None = None) -> MemoryReport:
    st, (acts, logits, in_flight) = parts or _rank_parts(key, L, work, pp_rank)
    overhead = gpu_overhead(acts + logits, communicators(L.dp, L.tp, L.pp, L.cp))
    comps = {"params": float(st.params), "grads": float(st.grads), "optimizer": float(st.optimizer),
             "activations": acts, "logits": logits, "comm_buffers": comm.at_peak(logits), "overhead": overhead}
    host = float(st.cpu_optimizer) + _host_activations(key, _activation_fields(L), work, pp_rank)
    return MemoryReport(comps, pp_rank, host, in_flight, disk_bytes=float(st.disk))


def _rank_parts(key: ModelKey, L: Layout, work: Workload,
                pp_rank: int) -> tuple[ModelStates, tuple[float, float, int]]:
    full, shard = rank_state_numels(key, L, pp_rank)
    st = _states(full, shard, L.zero_stage, work.param_bytes, L.offload_optimizer, L.offload_to, L.offload_params,
                 pipelined=L.pp > 1, accumulates=L.microbatches(work.global_batch) > 1)
    if L.grad_compression == "int8" and L.dp * L.cp > 1:  # error feedback: fp32, gradient-sized
        st = dataclasses.replace(st, grads=st.grads + int8_residual_bytes(full, L.dp * L.cp, L.zero_stage)
                                 + replica_residual_bytes(L, shard))
    if L.pipeline_schedule == "2bw" and L.pp > 1:  # PipeDream-2BW: the stage's second weight version
        st = dataclasses.replace(st, params=st.params + work.param_bytes * full)
    acts, logits, in_flight = _rank_activations(key, _activation_fields(L), work, pp_rank, live=True)
    part = layer_partition(key, L.pp, L.virtual_stages if L.pp > 1 else 1, L.pp > 1 and v_shaped(L.pipeline_schedule))
    if part.chunks[-1].rank == pp_rank:  # the rank with the head (the last chunk's)
        logits += loss_backward_bytes(L, work, padded(_vocab_size(key), L.tp) // L.tp, _dim(key))
    if gradients_dropped(L, work) and acts + logits >= st.grads:
        st = dataclasses.replace(st, grads=0)  # the peak (backward's start) comes before any gradient
    elif L.zero_stage >= 2 and L.pp == 1 and not L.offload_optimizer and acts + logits >= work.param_bytes * shard:
        # the reduced shard is written as backward frees the activations: not there at the peak
        st = dataclasses.replace(st, grads=st.grads - work.param_bytes * shard)
    return st, (acts, logits, in_flight)


_FIELD = {f.name: i for i, f in enumerate(dataclasses.fields(ModelConfig))}  # a field's place in a ModelKey


def _vocab_size(key: ModelKey) -> int:
    return key[_FIELD["vocab_size"]]


def _dim(key: ModelKey) -> int:
    return key[_FIELD["dim"]]


def gradients_dropped(L: Layout, work: Workload) -> bool:
    """Whether a step's gradients do not exist when its backward begins: ZeRO-0 with no
    data-parallel peers keeps no reduction buckets, so ``zero_grad`` drops the gradients
    (:class:`hybridpar.parallel.zero.stages.Replicated`), and with one micro-batch per step and no
    pipeline the first gradient is written after the loss's backward, the activation peak. From
    there each layer's backward frees more activations than it adds gradients, unless the
    gradients outweigh the activations (then the end of backward, with every gradient, is the
    peak, and :func:`_rank_parts` keeps them)."""
    return L.zero_stage == 0 and L.dp * L.cp == 1 and L.pp == 1 and L.microbatches(work.global_batch) == 1


def int8_residual_bytes(full: int, n: int, zero_stage: int) -> int:
    """int8 gradient compression's error-feedback state on a rank holding ``full`` parameter
    elements over ``n`` data-parallel ranks: 4 bytes per gradient element (the quantised
    input), plus 4 per element of this rank's summed block at stage 0 (re-quantised for the
    all-gather); block padding left out. Counted with the gradients."""
    return 4 * full + (4 * -(-full // n) if zero_stage == 0 else 0)


def rank_state_numels(key: ModelKey, L: Layout, pp_rank: int) -> tuple[int, int]:
    """(elements held, elements of the worst ZeRO shard) of pipeline rank ``pp_rank``: ZeRO
    shards over dp x cp (the runtime's ``dp_cp`` axis); with ep > 1 the routed experts are an
    optimizer of their own sharded over ``edp = dp * cp / ep`` (each ``[E/ep, ...]`` tensor in
    ``ceil((E/ep) / edp)``-row blocks: with one expert per rank, one edp rank holds it all).
    Hybrid sharding (``dp_shard``): over the ZeRO group instead (:func:`hybridpar.planner.model.hsdp.zero_group`)."""
    edp = expert_group(L)[1] if L.ep > 1 else 1
    return _rank_state_numels(key, L.tp, L.pp, L.virtual_stages, pp_rank, zero_group(L)[1], L.ep, edp,
                              v_shaped(L.pipeline_schedule))


@functools.lru_cache(maxsize=65536)
def _rank_state_numels(key: ModelKey, tp: int, pp: int, virtual_stages: int, pp_rank: int, n: int, ep: int,
                       edp: int, v_shape: bool) -> tuple[int, int]:
    """:func:`rank_state_numels` of the fields it reads (ZeRO group ``n``, expert group ``edp``),
    memoised: every recompute level and ZeRO stage of a candidate holds the same elements."""
    args, vs = (key, tp, pp, virtual_stages, pp_rank), {"v_shape": v_shape}
    if ep == 1:
        return rank_numel(*args, **vs), rank_numel(*args, n, **vs)
    full = rank_numel(*args, 1, ep, "dense", **vs) + rank_numel(*args, 1, ep, "experts", **vs)
    return full, rank_numel(*args, n, ep, "dense", **vs) + rank_numel(*args, edp, ep, "experts", **vs)


def _total(st: ModelStates, acts: float, logits: float, comm: CommBuffers, axes: int) -> float:
    """``MemoryReport.total`` of these parts (the same sum, in the same order); ``axes`` mesh axes
    with peers."""
    overhead = gpu_overhead(acts + logits, axes)
    return sum((float(st.params), float(st.grads), float(st.optimizer), acts, logits, comm.at_peak(logits), overhead))


def candidate_ranks(key: ModelKey, pp: int, virtual_stages: int, kind: str,
                    microbatches: int) -> tuple[int, ...]:
    """:func:`_candidate_ranks` of the :func:`peak_microbatches` that decide it."""
    return _candidate_ranks(key, pp, virtual_stages, kind, peak_microbatches(kind, pp, microbatches))


@functools.lru_cache(maxsize=4096)
def _candidate_ranks(key: ModelKey, pp: int, virtual_stages: int, kind: str,
                     microbatches: int) -> tuple[int, ...]:
    """The pipeline ranks that can hold the most memory. Ranks whose chunks have the same layer
    counts, embedding and head hold the same parameters and buffers; of those, a rank each of
    whose peak vectors (:func:`live_chunk_counts`) another rank's covers holds no more of
    anything, and is dropped (of ranks covering each other, the first is kept, as ``max``
    keeps the first of equal totals)."""
    part = layer_partition(key, pp, virtual_stages, v_shaped(kind))
    groups: dict[tuple, list[tuple[int, tuple[tuple[int, ...], ...]]]] = {}
    for r in range(pp):
        sig = tuple((len(c.layers), c.embedding, c.head) for c in part.for_rank(r))
        groups.setdefault(sig, []).append((r, live_chunk_counts(kind, pp, virtual_stages, microbatches, r)))

    def covers(big: tuple[tuple[int, ...], ...], small: tuple[tuple[int, ...], ...]) -> bool:
        return all(any(all(a >= b for a, b in zip(x, y, strict=True)) for x in big) for y in small)

    out = []
    for members in groups.values():
        for r, vecs in members:
            if not any(q != r and covers(theirs, vecs) and (q < r or not covers(vecs, theirs))
                       for q, theirs in members):
                out.append(r)
    return tuple(sorted(out))


def memory_bound(model: ModelConfig, layout: Layout, work: Workload, hint: int | None = None) -> float | None:
    """A lower bound of ``plan_memory(model, layout, work).total``: the total of one of the
    pipeline ranks it compares (``hint`` when it is one, else the first), computed as it does,
    so never above the worst rank's. None when it compares one rank only (the bound would be
    the answer: evaluate it instead)."""
    if layout.pp == 1:
        return None
    ranks = candidate_ranks(model_key(model), layout.pp, layout.virtual_stages, layout.pipeline_schedule,
                            layout.microbatches(work.global_batch))
    if len(ranks) == 1:
        return None
    key, comm = model_key(model), comm_buffer_bytes(model, layout, work)
    st, (acts, logits, _) = _rank_parts(key, layout, work, hint if hint in ranks else ranks[0])
    return _total(st, acts, logits, comm, communicators(layout.dp, layout.tp, layout.pp, layout.cp))


def plan_memory(model: ModelConfig, layout: Layout, work: Workload) -> MemoryReport:
    """The pipeline rank with the largest total (the one that OOMs first), not the average."""
    key, comm = model_key(model), comm_buffer_bytes(model, layout, work)
    ranks = (0,) if layout.pp == 1 else candidate_ranks(
        key, layout.pp, layout.virtual_stages, layout.pipeline_schedule, layout.microbatches(work.global_batch))
    if len(ranks) == 1:
        return _rank_memory(model, key, layout, work, ranks[0], comm)
    totals, parts = [], []
    for r in ranks:
        parts.append(_rank_parts(key, layout, work, r))
        st, (acts, logits, _) = parts[-1]
        totals.append(_total(st, acts, logits, comm, communicators(layout.dp, layout.tp, layout.pp, layout.cp)))
    worst = totals.index(max(totals))  # the first of equals, as max over reports
    return _rank_memory(model, key, layout, work, ranks[worst], comm, parts[worst])
