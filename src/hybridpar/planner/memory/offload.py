"""Activation offload in the planner (``parallel.offload_activations``,
:mod:`hybridpar.parallel.offload_activations`): what it takes off the device, what it brings
back, what it puts in host memory, and what its copies cost.

Per micro-batch of a pipeline chunk, the first ``offloaded_count(n, fraction)`` of its ``n``
layers keep in device memory none of what they save for backward (:func:`layer_offload_bytes`):
their activations as :mod:`hybridpar.planner.memory.activations` counts them (with ``recompute``: what recomputation
keeps) and, under autocast, the half weight copies their linears saved. What stays anyway:

* ZB-H1 / ZBV: the inputs the deferred linears keep until W (saved by the W split itself; not on
  the first stage, which runs B and W as one backward);
* pipeline chunks after the first, fp32 residual: the first layer's input, which the runner holds
  as the received activation.

While backward runs, the offloaded storages of two layers are back on the device at once (the one
whose backward runs and the one fetched next, :func:`working_bytes`), plus with full recompute the
recomputed layer's activations; by then the head's tensors and the chunk's later (not offloaded)
layers' activations are freed (:func:`offload_peak` in :mod:`hybridpar.planner.memory.plan`).

Time: each offloaded layer moves its bytes to host during forward and back during backward over
the GPU's host link (``GPUSpec.host_bw``); the copies run on a side stream, so only what exceeds
the layer's own forward (backward) compute is exposed (:func:`exposed_seconds`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridpar.config import ModelConfig
from hybridpar.parallel.offload_count import offloaded_count
from hybridpar.parallel.pipeline.partition import ChunkSpec
from hybridpar.planner.memory.activations import (
    deferred_layer_bytes,
    layer_activation_bytes,
    layer_weight_cast_bytes,
)
from hybridpar.planner.model.layout import BlockStyle, Layout, Workload

if TYPE_CHECKING:
    from hybridpar.planner.memory.plan import ChunkBytes

__all__ = ["ChunkOffload", "chunk_offload", "exposed_seconds", "layer_offload_bytes", "offload_layer_times",
           "offload_peak", "offloaded_layers"]


def offloaded_layers(layout: Layout, chunk: ChunkSpec) -> list[int]:
    """The layers of ``chunk`` whose activations go to host memory (its first ones)."""
    if not layout.offload_activations:
        return []
    n = len(chunk.layers)
    return list(chunk.layers[:offloaded_count(n, layout.offload_activations_fraction)])


def _zero_bubble(layout: Layout) -> bool:
    return layout.pp > 1 and layout.pipeline_schedule in ("zb-h1", "zbv")


def layer_kept_bytes(model: ModelConfig, layout: Layout, work: Workload, layer: int) -> float:
    """What layer ``layer`` keeps for backward per micro-batch without offload: its activations
    and, under autocast and without full recompute, its saved half weight copies."""
    moe = layer in set(model.moe_layer_ids())
    kept = layer_activation_bytes(model, layout, work, moe=moe)
    if work.act_bytes != work.param_bytes and layout.recompute != "full" and work.style is BlockStyle.EAGER:
        kept += layer_weight_cast_bytes(model, layer, layout.tp, layout.ep, work.act_bytes)
    return kept


def layer_offload_bytes(model: ModelConfig, layout: Layout, work: Workload, layer: int, split: bool = True) -> float:
    """Bytes one offloaded layer moves to host memory per micro-batch (and back): what it keeps
    (:func:`layer_kept_bytes`) but what a zero-bubble schedule's deferred linears hold on the
    device until W (their inputs; the half weight copies they keep are counted with W's).
    ``split``: its chunk's backward is split (not on the first stage, whose B the runner fuses
    with its W: :func:`hybridpar.parallel.pipeline.runtime.fused_backward`)."""
    kept = layer_kept_bytes(model, layout, work, layer)
    if split and _zero_bubble(layout) and layout.recompute != "full":
        tok = layout.micro_batch * (work.seq_len // layout.cp)
        inputs, _ = deferred_layer_bytes(model, layout.tp, work.act_bytes, work.param_bytes)
        kept -= tok * inputs
        if work.act_bytes != work.param_bytes:
            kept -= layer_weight_cast_bytes(model, layer, layout.tp, layout.ep, work.act_bytes)
    return max(0.0, kept)


class ChunkOffload:
    """What offload changes for one micro-batch of one chunk: ``saved`` (device bytes it takes
    off the chunk's body), ``later`` (the chunk's layers not offloaded, freed before the offloaded
    ones' backward), ``working`` (bytes back on the device during their backward), ``moved``
    (bytes in host memory)."""

    def __init__(self, saved: float, later: float, working: float, moved: float = 0.0) -> None:
        self.saved, self.later, self.working, self.moved = saved, later, working, moved


def chunk_offload(model: ModelConfig, layout: Layout, work: Workload, chunk: ChunkSpec) -> ChunkOffload:
    """:class:`ChunkOffload` of ``chunk`` under ``layout`` (module docstring)."""
    chosen = offloaded_layers(layout, chunk)
    if not chosen:
        return ChunkOffload(0.0, 0.0, 0.0)
    moe_ids = set(model.moe_layer_ids())
    kinds = {i in moe_ids: i for i in chunk.layers}  # a layer of each kind: their bytes are the same
    per_kind = {moe: layer_offload_bytes(model, layout, work, i, split=not chunk.embedding) for moe, i in kinds.items()}
    kept = {moe: layer_kept_bytes(model, layout, work, i) for moe, i in kinds.items()}
    moved = [per_kind[i in moe_ids] for i in chosen]
    saved = sum(moved)
    if layout.pp > 1 and not chunk.embedding and work.param_bytes == 4:
        sp = layout.sequence_parallel and layout.tp > 1
        tok = layout.micro_batch * (work.seq_len // layout.cp)
        saved -= tok * model.dim * work.param_bytes / (layout.tp if sp else 1)  # the runner's received input
    later = sum(kept[i in moe_ids] for i in chunk.layers if i not in chosen)
    working = sum(sorted(moved)[-2:])
    return ChunkOffload(saved, later, working, sum(moved))


def offload_peak(vectors: tuple[tuple[int, ...], ...], sizes: list[ChunkBytes], offloads: list[ChunkOffload],
                 transient: float) -> float:
    """The most an offloaded layer's backward holds (:mod:`hybridpar.planner.memory.offload`): at a peak vector where a
    micro-batch of chunk ``c`` is alive, its two layers back on the device (and with full
    recompute the recomputed one's activations), its head and its later layers freed by then."""
    v, most = len(sizes), 0.0
    for vec in vectors:
        total = sum(n * (cb.body + cb.head) + g * cb.deferred for n, g, cb in zip(vec[:v], vec[v:], sizes, strict=True))
        for n, cb, o in zip(vec[:v], sizes, offloads, strict=True):
            if n and o.working:
                most = max(most, total - cb.head - o.later + o.working + transient)
    return most


def exposed_seconds(nbytes: float, compute_s: float, host_bw: float) -> float:
    """Seconds a copy of ``nbytes`` over the host link adds beside ``compute_s`` of compute it
    overlaps (a side stream: only the excess shows)."""
    return max(0.0, nbytes / host_bw - compute_s)


def offload_layer_times(model: ModelConfig, layout: Layout, work: Workload, host_bw: float, f: float, b: float,
                        moe: bool = False) -> tuple[float, float]:
    """A layer's forward and backward seconds ``(f, b)`` with activation offload: the offloaded
    share of the layers adds what of its copy to host (back to the device) the forward (backward)
    compute does not hide (:func:`exposed_seconds`)."""
    if not layout.offload_activations:
        return f, b
    per_chunk = max(1, model.n_layers // (layout.pp * layout.virtual_stages))
    share = offloaded_count(per_chunk, layout.offload_activations_fraction) / per_chunk
    moe_ids = model.moe_layer_ids()
    layer = moe_ids[0] if moe and moe_ids else next((i for i in range(model.n_layers) if i not in moe_ids), 0)
    nbytes = layer_offload_bytes(model, layout, work, layer)
    return (f + share * exposed_seconds(nbytes, f, host_bw), b + share * exposed_seconds(nbytes, b, host_bw))


