"""Buffers of the collectives in flight on one rank, by when they live (:class:`CommBuffers`),
for :mod:`hybridpar.planner.memory.plan`'s ``comm_buffers`` component."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpar.config import ModelConfig
from hybridpar.planner.model.layout import Layout, Workload
from hybridpar.planner.model.moe import dispatch_rows, rank_load
from hybridpar.planner.model.shapes import layer_shapes


@dataclass(frozen=True)
class CommBuffers:
    """Buffers of the collectives in flight (the same on every pipeline rank), by when they live:
    ``boundary`` (pipeline sends and receives, held beside a stage's activations) and ``in_layer``
    (ZeRO-3's gathered layers, ring attention's blocks, the expert dispatch: alive only inside a
    layer's forward or backward)."""

    boundary: float = 0.0
    in_layer: float = 0.0

    def at_peak(self, head: float) -> float:
        """What of them is alive at the rank's peak. On the rank with the loss the peak is the
        loss's backward, where no layer runs (``head``: the ``logits`` term, freed before the last
        layer's backward starts): the in-layer buffers count only beyond it, the peak moving into
        that layer's backward (``hybridpar train --dry-run`` measures none of them at the loss)."""
        return self.boundary + max(0.0, self.in_layer - head)


def comm_buffer_bytes(model: ModelConfig, layout: Layout, work: Workload) -> CommBuffers:
    """Buffers of the collectives in flight (:class:`CommBuffers`)."""
    L, t, ab = layout, layout.tp, work.act_bytes
    sp = L.sequence_parallel and t > 1
    s, b, h = work.seq_len // L.cp, L.micro_batch, model.dim
    boundary = in_layer = 0.0
    # no term for data parallelism's gradient buckets: the gradients live in the buckets and are
    # reduced in place (``hybridpar train --dry-run`` measures no other tensor; NCCL's own staging
    # buffers are the allocator term's communicators, :mod:`.allocator`)
    if L.zero_stage == 3 and L.pp == 1:  # one gathered layer in use and the prefetched next one (pp: in params)
        kinds = {0, *model.moe_layer_ids()[:1]}  # a dense layer (if any) and an MoE layer
        layer = max(sum(math.prod(sh) for _, sh in layer_shapes(model, t, i, L.ep)) for i in kinds)
        in_layer += 2 * work.param_bytes * layer
    # no term for tensor parallelism: its all-reduces run in place and an SP gather's output is a
    # saved activation; at the peak (the loss) none is in flight (``hybridpar train --dry-run``)
    if L.pp > 1:  # one send and one receive buffer per direction
        boundary += 4 * s * b * h * ab / (t if sp else 1)
    if L.cp > 1:  # ring attention: the K and V blocks in use and the ones arriving
        in_layer += 2 * 2 * s * b * model.n_kv_heads * model.head_dim * ab / t
    if L.ep > 1 and model.moe_layer_ids():  # the dispatch's rows to send and the rows received
        load = rank_load(work.moe_imbalance, L.ep, model.n_experts)
        _, _, rows = dispatch_rows(s * b, model.experts_per_token, L.ep, load)
        in_layer += (model.experts_per_token * s * b + rows) * h * work.param_bytes
    return CommBuffers(boundary, in_layer)
