"""Payload bytes per mesh axis of one training step, as the runtime's comm counter records them.

:func:`comm_bytes` walks the same operations as one ``Trainer.train_step`` (forward and backward
of every micro-batch through :class:`~hybridpar.training.engine.Engine`, gradient reduction,
the loss average, the gradient norm, the optimizer step) and counts, per ``(op, axis)``, the
payload :class:`~hybridpar.distributed.comm.CommCounter` records: the whole tensor for
all-reduce, broadcast, send and recv; the local shard for all-gather; the full input for
reduce-scatter; nothing on a size-1 axis. Axis names are the counter's: ``tp``, ``cp``, ``pp``,
``dp``, ``dp_cp`` (gradients over dp x cp when both are > 1), ``<axis>.intra`` / ``.inter``
(hierarchical data parallelism) and ``world`` (the fp16 overflow flag).

Per micro-batch of ``b`` sequences of ``s`` tokens on the rank (``s = seq / cp``) and ``d =
b s h``: tensor parallelism moves, per norm (2 per layer and the final one), one ``d`` all-reduce
backward (f) and, per row-parallel layer (2 per layer), one forward (g); with SP an all-gather of
``d/t`` forward and a reduce-scatter of ``d`` backward per norm, the converse per row-parallel
layer; the vocab-parallel embedding one more g, the loss two all-reduces of 1 and 2 fp32 per
token. Ring attention sends and receives, per layer, ``cp - 1`` K/V blocks forward, ``cp - 1``
backward and ``cp - 1`` fp32 dK/dV blocks. Pipeline ranks send and receive one ``d/t_SP`` fp32
hidden state per stage boundary and micro-batch each way, then broadcast the ``M`` losses. ZB-H1's
W runs only the linears' weight-gradient GEMMs, no collective. Activation recomputation reruns forward
collectives in each backward traversal: a block's tp and cp ones (full), ring attention's
(selective).
Gradients cross dp x cp once per step: bucketed all-reduces (ZeRO-0), a reduce-scatter per
bucket and an all-gather of the updated shard (ZeRO-1/2), or two all-gathers per unit and
micro-batch and one reduce-scatter per unit (ZeRO-3), each over the padded ``ceil(rows/N)``
shard layout of the rank's tp pieces. ``grad_compression``: int8 turns each reduce-scatter into
one all-to-all of int8 blocks with fp32 scales (ZeRO-0: plus an all-gather of the summed
blocks); bf16/fp16 halve the reduce-scatter payload. Then one fp32 scalar for the logged loss and fp64 ones for the
gradient norm's partial sums over tp, the ZeRO axis and pp.
Dtypes: the residual stream and gradients are in the parameter dtype, matmul outputs and
attention inputs in the matmul dtype, losses fp32, the norm's partial sums fp64.

Mixture of experts (:func:`~hybridpar.planner.price.layer_traffic.moe_collectives`, :mod:`hybridpar.planner.model.moe`): per MoE layer and micro-batch the
routing weights (and under SP the expert ids) enter the tp region, the router sums its counts over
cp (and tp under SP), and over ``ep`` the counts, the dispatched rows and the combined rows go
forward and their gradients back (the busiest rank's ``load``, or ``ep_load`` given); the routed
experts' gradients go over ``edp`` (their own ZeRO optimizer); once per step the trainer's MoE
statistics (loads, auxiliary loss), once per step (the bias update reuses the load).

ZeRO-3 with pp > 1 gathers each of the rank's chunks once per step and reduce-scatters it once
(:class:`hybridpar.parallel.zero.zero3_pp.StageSharded`). Hybrid sharding (:mod:`hybridpar.planner.model.hsdp`):
ZeRO on ``dp_shard`` (``edp_shard``), then each reduced shard on ``dp_replicate`` (``edp_replicate``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable

from hybridpar.config import ModelConfig
from hybridpar.distributed.int8_blocks import padded as padded_blocks
from hybridpar.distributed.int8_blocks import wire_numel
from hybridpar.parallel.pipeline.partition import ChunkSpec
from hybridpar.parallel.pipeline.schedules import stage_rank
from hybridpar.parallel.zero.reducer import cut_buckets
from hybridpar.planner.model import hsdp as hs
from hybridpar.planner.model.layout import Layout, Workload, model_key
from hybridpar.planner.model.moe import is_expert, rank_load, replicated_ffn
from hybridpar.planner.model.shapes import (
    embedding_at_head,
    layer_partition,
    layer_shapes,
    mtp_shapes,
    padded,
    shard_elems,
    v_shaped,
)
from hybridpar.planner.price.cp import cp_collectives
from hybridpar.planner.price.fp8 import amax_all_reduces, zero3_gather
from hybridpar.planner.price.layer_traffic import moe_collectives, mtp_collectives, tp_region
from hybridpar.rules import fp8_gathers

Shape = tuple[int, ...]
Named = list[tuple[str, Shape]]
Adder = Callable[..., None]  # add(op, axis, axis size, payload bytes, times=1)

AXES = ("tp", "cp", "pp", "dp")
NORM_BYTES = 8  # one partial sum of the gradient norm: fp64 (parallel.tensor_plan.sum_of_squares)


def _layer_params(model: ModelConfig, tp: int, i: int, ep: int = 1) -> Named:
    """Layer ``i``'s parameters in registration order (:func:`~hybridpar.planner.model.shapes.layer_shapes`)."""
    return [(f"layers.{i}.{n}", s) for n, s in layer_shapes(model, tp, i, ep)]


def model_params(model: ModelConfig, tp: int, ep: int = 1) -> Named:
    """The whole model's ``named_parameters()`` (tp- and ep-local shapes), in registration order."""
    vocab = padded(model.vocab_size, tp) // tp
    out: Named = [("tok_embeddings.weight", (vocab, model.dim))]
    for i in range(model.n_layers):
        out += _layer_params(model, tp, i, ep)
    out.append(("norm.weight", (model.dim,)))
    if not model.tie_embeddings:
        out.append(("output.weight", (vocab, model.dim)))
    return out + mtp_shapes(model, tp, ep)


def rank_params(model: ModelConfig, layout: Layout, pp_rank: int) -> Named:
    """The parameters the Engine trains on pipeline rank ``pp_rank`` (its chunks' parameters in
    chunk order, a tied embedding's mirror once), as the gradient reducer sees them."""
    if layout.pp == 1:
        return model_params(model, layout.tp, layout.ep)
    return [np for chunk in rank_chunk_params(model, layout, pp_rank) for np in chunk]


def rank_chunk_params(model: ModelConfig, layout: Layout, pp_rank: int) -> list[Named]:
    """:func:`rank_params` per local pipeline chunk (pp > 1), a parameter two chunks share (ZBV's
    tied embedding) in the first: ZeRO-3's units under pp (``StageSharded``)."""
    vocab = padded(model.vocab_size, layout.tp) // layout.tp
    out: list[Named] = []
    seen = False  # the embedding weight, once
    for c in layer_partition(model_key(model), layout.pp, layout.virtual_stages,
                             v_shaped(layout.pipeline_schedule)).for_rank(pp_rank):
        chunk: Named = []
        tied_here = c.head and embedding_at_head(model)
        if (c.embedding or tied_here) and not seen:
            chunk.append(("tok_embeddings.weight", (vocab, model.dim)))
            seen = True
        for i in c.layers:
            chunk += _layer_params(model, layout.tp, i, layout.ep)
        if c.head:
            chunk.append(("norm.weight", (model.dim,)))
            if not model.tie_embeddings:
                chunk.append(("output.weight", (vocab, model.dim)))
            chunk += mtp_shapes(model, layout.tp, layout.ep)
        out.append(chunk)
    return out


_numel = math.prod  # a shape's element count


def buckets(shapes: Iterable[Shape], elem: int, bucket_bytes: int) -> list[list[Shape]]:
    """Parameters in reverse order cut every ``bucket_bytes`` (GradientReducer and ZeRO-1/2)."""
    return cut_buckets(shapes, lambda s: _numel(s) * elem, bucket_bytes)


def _dp_cp_name(layout: Layout) -> str:
    """The counter's name of the gradient-averaging axis (``Topology.dp_cp``)."""
    if layout.dp > 1 and layout.cp > 1:
        return "dp_cp"
    return "cp" if layout.dp == 1 else "dp"


def _node_split(layout: Layout, pp_rank: int, node_size: int) -> tuple[int, int]:
    """(intra, inter) sizes of the dp x cp group of pipeline rank ``pp_rank`` (tp rank 0) cut at
    node boundaries of ``node_size`` global ranks (``Topology.node_split``)."""
    L = layout
    ranks = [((pp_rank * L.dp + d) * L.cp + c) * L.tp for d in range(L.dp) for c in range(L.cp)]
    nodes: dict[int, int] = defaultdict(int)
    for r in ranks:
        nodes[r // node_size] += 1
    intra = nodes[ranks[0] // node_size]
    return intra, len(ranks) // intra


def comm_bytes(model: ModelConfig, layout: Layout, work: Workload, pp_rank: int = 0, *,
               zero_rank: int = 0, hierarchical_node: int = 0,
               ep_load: float | None = None) -> dict[tuple[str, str], int]:
    """``{(op, axis): payload bytes}`` pipeline rank ``pp_rank`` records in one training step.
    Any tp coordinate records the same, and so does any dp x cp coordinate except that with SP
    and ZeRO the norm-weight rows summed over tp are those of ZeRO rank ``zero_rank`` (they differ
    only when ``dim`` is not a multiple of dp x cp). ``hierarchical_node``: ranks per node when
    gradients use the hierarchical all-reduce (``parallel.hierarchical_dp``), else 0.
    ``ep_load``: the routed rows this rank's experts receive relative to the mean (MoE with
    ep > 1; :mod:`hybridpar.planner.model.moe`), default the busiest rank's under ``work.moe_imbalance``."""
    L = layout
    out: dict[tuple[str, str], int] = defaultdict(int)

    def add(op: str, axis: str, size: int, nbytes: float, times: int = 1) -> None:
        if size > 1 and times > 0:
            out[(op, axis)] += int(nbytes) * times

    chunks = layer_partition(model_key(model), L.pp, L.virtual_stages, v_shaped(L.pipeline_schedule)).for_rank(pp_rank)
    load = rank_load(work.moe_imbalance, L.ep, model.n_experts) if ep_load is None else ep_load
    for c in chunks:
        _chunk_collectives(add, model, L, work, c, load)
    if L.pp > 1:
        _pipeline_p2p(add, model, L, work, chunks, pp_rank)
    names, experts = _gradient_collectives(add, model, L, work, pp_rank, hierarchical_node)
    _step_scalars(add, model, L, work, names, experts, zero_rank)
    return dict(out)


def _chunk_collectives(add: Adder, model: ModelConfig, L: Layout, work: Workload, c: ChunkSpec,
                       load: float) -> None:
    """The step's collectives inside pipeline chunk ``c``'s layers (tp, ring attention, their
    reruns under recomputation, MoE), for every micro-batch."""
    t, sp = L.tp, L.sequence_parallel and L.tp > 1
    r, a = work.param_bytes, work.act_bytes
    s, b, h = work.seq_len // L.cp, L.micro_batch, model.dim
    m = L.microbatches(work.global_batch)
    d = b * s * h  # one full-length hidden state of a micro-batch on this rank
    n_c = len(c.layers)
    # tensor parallelism, per micro-batch: norm entries (f / SP all-gather forward), row-parallel
    # exits (g / SP reduce-scatter), the embedding's exit, the vocab-parallel loss
    tp_region(add, L, work, d, 2 * n_c + c.head, n_c, c.embedding, m)
    if c.head:
        add("all_reduce", "tp", t, 3 * b * s * 4, m)  # max, then (sum of exp, target logit)
    if c.head and model.mtp_layers:
        mtp_collectives(add, model, L, work, m, load)
    # recomputation reruns, in every backward traversal, the forward collectives of each
    # block (full: SP's gathers, ring attention, the attention exit) or of its attention
    # core (selective: ring attention). torch's checkpoint stops a block's recomputation once
    # the last tensor backward needs is saved (the MLP's down projection input), so the MLP
    # exit's collective is not rerun.
    rerun = m if L.recompute != "none" else 0
    if L.recompute == "full" and sp:
        add("all_gather", "tp", t, 2 * n_c * d // t * r, rerun)
        add("reduce_scatter", "tp", t, n_c * d * a, rerun)
    elif L.recompute == "full":
        add("all_reduce", "tp", t, n_c * d * a, rerun)
    # context parallelism: ring attention's K/V hops, Ulysses' all-to-alls (and their reruns)
    cp_collectives(add, model, L, work, n_c, m, rerun)
    moe_ids = set(model.moe_layer_ids())
    n_moe = sum(i in moe_ids for i in c.layers)
    moe_collectives(add, model, L, work, n_moe, m, 1, m if L.recompute == "full" else 0, load)  # ZB's W: none
    amax_all_reduces(add, model, L, work, n_c - n_moe, n_moe, m, fp8_gathers(work.fp8, work.fp8_all_gather, L.zero_stage))


def _pipeline_p2p(add: Adder, model: ModelConfig, L: Layout, work: Workload, chunks: list[ChunkSpec],
                  pp_rank: int) -> None:
    """Pipeline traffic: hidden states forward, their gradients backward, the losses, the tied
    embedding's gradients (its mirror on the last stage: a tied head's, or the MTP modules')."""
    t, sp = L.tp, L.sequence_parallel and L.tp > 1
    m = L.microbatches(work.global_batch)
    d = L.micro_batch * (work.seq_len // L.cp) * model.dim
    msg = d // (t if sp else 1) * 4  # the runner's fp32 act_shape
    last, vs = L.pp * L.virtual_stages - 1, v_shaped(L.pipeline_schedule)

    def remote(a: int, b: int) -> bool:  # ZBV's turn (pp - 1 -> pp) stays on one rank
        return stage_rank(a, L.pp, vs) != stage_rank(b, L.pp, vs)

    sends = sum((c.stage < last and remote(c.stage, c.stage + 1)) + (c.stage > 0 and remote(c.stage, c.stage - 1))
                for c in chunks)
    add("send", "pp", L.pp, sends * msg, m)
    add("recv", "pp", L.pp, sends * msg, m)
    add("broadcast", "pp", L.pp, 4 * m)
    if embedding_at_head(model) and pp_rank in (0, L.pp - 1) and not vs:  # ZBV: both ends on rank 0
        tied = padded(model.vocab_size, t) // t * model.dim * work.param_bytes
        add("send", "pp", L.pp, tied)
        add("recv", "pp", L.pp, tied)


def _gradient_collectives(add: Adder, model: ModelConfig, L: Layout, work: Workload, pp_rank: int,
                          hierarchical_node: int) -> tuple[Named, Named]:
    """The gradients' reduction (and ZeRO's gathers); returns the rank's (dense, routed-expert)
    parameters: with ep > 1 the routed experts are a ZeRO optimizer of their own over edp."""
    r, m = work.param_bytes, L.microbatches(work.global_batch)
    everything = rank_params(model, L, pp_rank)
    experts = [(nm, sh) for nm, sh in everything if L.ep > 1 and is_expert(nm)]
    names = [(nm, sh) for nm, sh in everything if not (L.ep > 1 and is_expert(nm))]
    bucket_bytes = int(work.bucket_mb * 2**20)
    zero_axis, n = _dp_cp_name(L), L.dp * L.cp
    if L.zero_stage == 0 and L.grad_compression == "int8":
        for bucket in buckets([sh for _, sh in names], r, bucket_bytes):  # int8 reduce-scatter + all-gather
            _int8_reduce(add, zero_axis, n, -(-sum(_numel(s) for s in bucket) // n), gather=True)
    elif L.zero_stage == 0:
        _reduce_grads(add, L, [sh for _, sh in names], r, bucket_bytes, pp_rank, hierarchical_node)
    else:
        fp8 = fp8_gathers(work.fp8, work.fp8_all_gather, L.zero_stage)
        _zero(add, model, L, {nm for nm, _ in names}, r, m, bucket_bytes, pp_rank, hierarchical_node, fp8)
    if experts:
        _expert_grads(add, L, experts, r, m, bucket_bytes)
    return names, experts


def _step_scalars(add: Adder, model: ModelConfig, L: Layout, work: Workload, names: Named, experts: Named,
                  zero_rank: int) -> None:
    """The step's small sums: SP's replicated-weight gradients over tp, the logged loss, the
    gradient norm's partial sums, the MoE statistics and fp16's overflow flag."""
    t, sp, r = L.tp, L.sequence_parallel and L.tp > 1, work.param_bytes
    zero_axis, n = _dp_cp_name(L), L.dp * L.cp
    if sp:  # replicated weights (norms, routers) saw only this rank's sequence shard: one flat sum
        # over tp (of ZeRO's rows)
        repl = [sh for nm, sh in names if nm.endswith(("norm.weight", "eh_proj.weight")) or replicated_ffn(nm)]
        if L.zero_stage > 0:
            add("all_reduce", "tp", t, sum(_rows_of(sh[0], hs.zero_group(L)[1], zero_rank) * _numel(sh[1:]) for sh in repl) * r)
        else:
            add("all_reduce", "tp", t, sum(map(_numel, repl)) * r)
    add("all_reduce", zero_axis, n, 4)  # the logged loss
    _grad_norm(add, L, bool(experts))
    if model.moe_layer_ids():
        # the step's MoE statistics (Engine.moe_step_stats): every router's float64 load and the
        # auxiliary losses' sum, over tp (SP), pp and dp x cp (the bias update reuses that load)
        load = (len(model.moe_layer_ids()) + model.mtp_layers) * model.n_experts * 8  # MTP's routers too
        for axis, size in (("tp", t if sp else 1), ("pp", L.pp), (zero_axis, n)):
            add("all_reduce", axis, size, load + 8)
    if work.precision == "fp16":
        add("all_reduce", "world", L.world_size, 4)  # any rank overflowed?


def _grad_norm(add: Adder, L: Layout, experts: bool) -> None:
    """The gradient norm's partial sums (``StepEngine.grad_norm``): ONE all-reduce over the axis
    spanning every part's grid dimensions (tp, the part's ZeRO axes, pp) where such an axis
    exists; otherwise, per optimizer part, over tp, then its ZeRO rows (experts: ep, then edp
    rows), then the stages, in turn."""
    sizes = {"pp": L.pp, "dp": L.dp, "cp": L.cp, "tp": L.tp}
    spans = [_norm_dims(L, False)] + ([_norm_dims(L, True)] if experts else [])
    if hs.hsdp(L):  # a ZeRO group of dp_shard ranks: a whole sub-mesh only as the cp axis
        spans = [None] if hs.grad_norm_axis(L, experts) is None else [{"cp"}]
    if all(d is not None for d in spans):
        union = set().union(*spans)
        axes = (("tp", {"tp"}), ("pp", {"pp"}), ("dp", {"dp"}), ("cp", {"cp"}), (_dp_cp_name(L), {"dp", "cp"}),
                ("world", set(sizes)))
        for name, dims in axes:
            if {d for d in dims if sizes[d] > 1} == union:
                add("all_reduce", name, math.prod(sizes[d] for d in union), NORM_BYTES)
                return
    for part_is_experts in ([False, True] if experts else [False]):
        add("all_reduce", "tp", L.tp, NORM_BYTES)
        if part_is_experts:
            add("all_reduce", "ep", L.ep, NORM_BYTES)
        if L.zero_stage > 0:
            name, size, _ = hs.expert_group(L) if part_is_experts else hs.zero_group(L)
            add("all_reduce", name, size, NORM_BYTES)
        add("all_reduce", "pp", L.pp, NORM_BYTES)


def _norm_dims(L: Layout, experts: bool) -> set[str] | None:
    """The grid dimensions (of size > 1) one optimizer part's norm terms span: tp, pp, its ZeRO
    axis (dp x cp; experts: ep, then edp). None where ep or edp is no whole sub-mesh (ep groups
    are consecutive in dp x cp, cp fastest: whole for ep in 1, cp, dp x cp)."""
    dims = {d for d, size in (("tp", L.tp), ("pp", L.pp)) if size > 1}
    dp_cp = {d for d, size in (("dp", L.dp), ("cp", L.cp)) if size > 1}
    if not experts:
        return dims | (dp_cp if L.zero_stage > 0 else set())
    if L.ep not in (1, L.cp, L.dp * L.cp):
        return None
    ep = set() if L.ep == 1 else (dp_cp if L.ep == L.dp * L.cp else {"cp"})
    edp = dp_cp - ep if L.zero_stage > 0 else set()
    return dims | ep | edp


def _reduce_grads(add: Adder, layout: Layout, shapes: list[Shape], elem: int, bucket_bytes: int,
                  pp_rank: int, node_size: int) -> None:
    """Data-parallel gradient buckets over dp x cp: one all-reduce each, or reduce-scatter in the
    node, all-reduce across nodes and all-gather in the node (hierarchical)."""
    name, n = _dp_cp_name(layout), layout.dp * layout.cp
    for bucket in buckets(shapes, elem, bucket_bytes):
        numel = sum(_numel(s) for s in bucket)
        if not node_size or n == 1:
            add("all_reduce", name, n, numel * elem)
            continue
        intra, inter = _node_split(layout, pp_rank, node_size)
        if intra == 1:
            add("all_reduce", f"{name}.inter", inter, numel * elem)
            continue
        pad = padded(numel, intra)
        add("reduce_scatter", f"{name}.intra", intra, pad * elem)
        add("all_reduce", f"{name}.inter", inter, pad // intra * elem)
        add("all_gather", f"{name}.intra", intra, pad // intra * elem)


def _int8_reduce(add: Adder, axis: str, n: int, shard: int, gather: bool = False) -> None:
    """int8 gradient compression (:mod:`hybridpar.distributed.compression`): the reduce-scatter
    of ``n`` blocks of ``shard`` elements is one all-to-all of int8 blocks padded to whole
    quantisation blocks, each with its fp32 scales; stage 0 then all-gathers the summed blocks."""
    msg = wire_numel(padded_blocks(shard))
    add("all_to_all", axis, n, n * msg)
    if gather:
        add("all_gather", axis, n, msg)


def _reduce_scatter(add: Adder, layout: Layout, axis: str, n: int, shard: int, elem: int, across: hs.Across = None) -> None:
    """ZeRO's gradient reduce-scatter of ``n`` blocks of ``shard`` elements, as compressed (HSDP: then ``across``)."""
    if layout.grad_compression == "int8":
        _int8_reduce(add, axis, n, shard)
    else:
        payload = 2 if layout.grad_compression in ("bf16", "fp16") else elem
        add("reduce_scatter", axis, n, n * shard * payload)
    if across is not None:
        across(shard)


def _zero_buckets(add: Adder, axis: str, n: int, shapes: list[Shape], elem: int, bucket_bytes: int,
                  layout: Layout, across: hs.Across = None) -> None:
    """ZeRO-1/2 over ``axis``: the optimizer's order (matrices, then vectors) cut in buckets from
    the end, each reduce-scattered once (as compressed) and its updated shard all-gathered."""
    order = [s for s in shapes if len(s) >= 2] + [s for s in shapes if len(s) < 2]
    for bucket in buckets(order, elem, bucket_bytes):
        shard = shard_elems(bucket, n)
        _reduce_scatter(add, layout, axis, n, shard, elem, across)
        add("all_gather", axis, n, shard * elem)


def _expert_grads(add: Adder, layout: Layout, experts: Named, elem: int, m: int, bucket_bytes: int) -> None:
    """The routed experts (ep > 1) over ``edp`` (the dp x cp / ep ranks that hold the same
    experts; nothing when ep = dp x cp): bucketed gradient all-reduces, ZeRO-1/2's buckets, or
    ZeRO-3's units (each MoE layer's experts: gathered twice per micro-batch, reduce-scattered
    once)."""
    (axis, n, stage, across), shapes = hs.expert_reduction(add, layout, elem), [sh for _, sh in experts]
    if stage == 0:
        for bucket in buckets(shapes, elem, bucket_bytes):
            if layout.grad_compression == "int8":
                _int8_reduce(add, axis, n, -(-sum(_numel(s) for s in bucket) // n), gather=True)
            else:
                add("all_reduce", axis, n, sum(_numel(s) for s in bucket) * elem)
    elif stage < 3:
        _zero_buckets(add, axis, n, shapes, elem, bucket_bytes, layout, across)
    else:
        units: dict[str, list[Shape]] = {}
        for nm, sh in experts:
            units.setdefault(nm.rsplit(".", 1)[0], []).append(sh)
        for unit in units.values():
            shard = shard_elems(unit, n)
            add("all_gather", axis, n, shard * elem, 2 * m)
            _reduce_scatter(add, layout, axis, n, shard, elem, across)


def _rows_of(rows: int, n: int, rank: int) -> int:
    """Rows ZeRO rank ``rank`` of ``n`` owns of a ``rows``-row parameter (``ceil`` blocks)."""
    block = -(-rows // n)
    return min((rank + 1) * block, rows) - min(rank * block, rows)


def _zero(add: Adder, model: ModelConfig, layout: Layout, names: set[str], elem: int, m: int,
          bucket_bytes: int, pp_rank: int = 0, node: int = 0, fp8: bool = False) -> None:
    """ZeRO over dp x cp, of the parameters this pipeline rank trains (tp pieces): stages 1/2
    bucket the optimizer's order (matrices, then vectors, reversed), reduce-scatter each bucket
    once and all-gather the updated shards; stage 3 gathers every unit (root: norm and head;
    embedding; each layer) twice per micro-batch and reduce-scatters it once; under pp its units
    are the rank's chunks, each gathered and reduce-scattered once per step (HSDP: :mod:`hybridpar.planner.model.hsdp`).
    ``fp8``: the gathers carry the FP8 linears' weights as FP8 (:func:`~hybridpar.planner.price.fp8.zero3_gather`)."""
    axis, n, across = hs.zero_reduction(add, layout, elem, pp_rank, node)
    named = [(nm, s) for nm, s in model_params(model, layout.tp) if nm in names]
    if layout.zero_stage < 3:
        _zero_buckets(add, axis, n, [s for _, s in named], elem, bucket_bytes, layout, across)
        return
    if layout.pp > 1:
        for chunk in rank_chunk_params(model, layout, pp_rank):
            shard = shard_elems([s for _, s in chunk], n)
            zero3_gather(add, axis, n, chunk, elem, 1, fp8)
            _reduce_scatter(add, layout, axis, n, shard, elem, across)
        return
    tied = model.tie_embeddings
    root = [(nm, s) for nm, s in named if nm in ("norm.weight", "output.weight") or (tied and nm.startswith("tok_"))]
    units = [root] + ([] if tied else [[named[0]]])
    dense = layout.ep == 1  # with ep > 1 the experts are units of their own over edp (_expert_grads)
    units += [[(nm, s) for nm, s in _layer_params(model, layout.tp, i, layout.ep) if dense or not is_expert(nm)]
              for i in range(model.n_layers)]
    for unit in units:
        shard = shard_elems([s for _, s in unit], n)
        zero3_gather(add, axis, n, unit, elem, 2 * m, fp8)
        _reduce_scatter(add, layout, axis, n, shard, elem, across)


def comm_bytes_per_axis(model: ModelConfig, layout: Layout, work: Workload, pp_rank: int = 0, *,
                        zero_rank: int = 0, hierarchical_node: int = 0,
                        ep_load: float | None = None) -> dict[str, int]:
    """``{axis: payload bytes}`` of one training step on pipeline rank ``pp_rank``: what
    ``topo.comm.counter.bytes(axis=axis)`` reads after one ``Trainer.train_step``."""
    out: dict[str, int] = defaultdict(int)
    for (_, axis), nbytes in comm_bytes(model, layout, work, pp_rank, zero_rank=zero_rank,
                                        hierarchical_node=hierarchical_node, ep_load=ep_load).items():
        out[axis] += nbytes
    return dict(out)
