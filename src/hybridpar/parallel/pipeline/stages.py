"""Cut a model into pipeline chunks without touching its code: the generic half.

A family supplies the chunk module (``hybridpar.models.<family>.pipeline``): embedding (first
chunk only), a contiguous run of the model's own decoder layers, and norm + head (last chunk
only), sharing the model's parameters under the model's names (``layers.3.attention.wq.weight``),
so optimizer, checkpoints and gradient comparisons work by name. What follows from the chunk
protocol alone lives here: which chunks a rank runs, who owns a parameter, and the tied
embedding's two copies.

The chunk protocol (:class:`StageChunk`): ``spec`` (its :class:`ChunkSpec`), ``tied`` (the head
reuses the embedding weight) and ``embedding_weight()`` (that weight, read when asked: ZeRO-3
swaps parameters), plus ``sequence_shards`` and ``positions``, which the engine sets.

Tied embeddings: with ``pp > 1`` the first and last stage sit on different ranks, so each holds
its own copy (same initial values); after every backward the trainer must sum the two copies'
gradients (:func:`sync_tied_embedding_grads`, an exchange between pp ranks 0 and pp-1 through
the comm layer) before clipping and the optimizer step. Both copies then see the same gradient
and the same optimizer state, so they stay identical. With pp = 1 it is one parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor, nn

from hybridpar.compat import free_storage, restore_storage, spans_whole_storage
from hybridpar.distributed.mesh import Topology
from hybridpar.parallel.pipeline.partition import ChunkSpec, Partition, partition_model


class StageChunk(Protocol):
    """What the pipeline needs of a family's chunk module (an ``nn.Module``)."""

    spec: ChunkSpec
    tied: bool
    sequence_shards: int
    positions: Tensor | None

    def embedding_weight(self) -> Tensor: ...


MakeChunk = Callable[[nn.Module, ChunkSpec], nn.Module]


def build_stage_modules(model: nn.Module, make_chunk: MakeChunk, pp_rank: int, pp: int,
                        virtual_stages: int = 1, partition: Partition | None = None,
                        v_shape: bool = False) -> list[nn.Module]:
    """The chunks pipeline rank ``pp_rank`` runs, in local-chunk order (chunk v is global stage
    ``v * pp + pp_rank``; with ``v_shape``, ZBV's stages ``pp_rank`` and ``2pp - 1 - pp_rank``).
    ``partition`` defaults to :func:`partition_model`'s (balanced by matmul FLOPs)."""
    if partition is None:
        partition = partition_model(model.cfg, pp, virtual_stages, v_shape=v_shape)
    if (partition.pp, partition.virtual_stages) != (pp, virtual_stages):
        raise ValueError(f"partition is for pp={partition.pp} V={partition.virtual_stages}, "
                         f"not pp={pp} V={virtual_stages}")
    return [make_chunk(model, spec) for spec in partition.for_rank(pp_rank)]


def tied_embedding_weight(chunks: list[nn.Module]) -> Tensor | None:
    """This rank's copy of the tied embedding weight if it is used at both ends of the model
    and this rank holds exactly one end (first or last stage); None otherwise."""
    ends = [c for c in chunks if c.tied and (c.spec.embedding or c.spec.head)]
    if not ends:
        return None
    if any(c.spec.embedding for c in ends) and any(c.spec.head for c in ends):
        return None  # both ends on this rank (pp = 1): one parameter, autograd sums both uses
    return ends[0].embedding_weight()


def owned_named_parameters(chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """This rank's parameters by model name, each once, leaving out the last stage's mirror of a
    tied embedding (owned by the first stage). Sum squared gradient norms of these over the pp
    axis for clipping; save these in checkpoints. (The optimizer still steps every parameter of
    the chunks, mirror included, so the mirror stays equal to the original.)"""
    mirror = tied_embedding_weight(chunks)
    holds_first = any(c.spec.embedding for c in chunks)
    out: dict[str, nn.Parameter] = {}
    for c in chunks:
        for name, p in c.named_parameters():
            if p is mirror and not holds_first:
                continue
            out.setdefault(name, p)
    return list(out.items())


@torch.no_grad()
def sync_tied_embedding_grads(chunks: list[nn.Module], topo: Topology) -> None:
    """Sum the gradients of the tied embedding's two copies (first stage on pp rank 0, last
    stage on pp rank pp-1) so both copies take the same optimizer step. Call it on every pp rank
    after the pipeline's backward and before clipping (ranks without a copy return at once).
    Implemented as a p2p exchange on the pp axis, so its bytes are counted."""
    weight = tied_embedding_weight(chunks)
    if weight is None or topo.pp.size == 1:
        return
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    peer = topo.pp.global_rank(topo.pp.size - 1 if topo.pp.rank == 0 else 0)
    theirs = torch.empty_like(weight.grad)
    topo.comm.batch_p2p([("send", weight.grad.clone(), peer), ("recv", theirs, peer)], topo.pp)
    # Same order of addition on both ranks (first stage's + last stage's), so the copies agree bit for bit.
    if topo.pp.rank == 0:
        weight.grad.add_(theirs)
    else:
        weight.grad.copy_(theirs.add_(weight.grad))


def release_other_stages(model: nn.Module, trained: list[nn.Parameter]) -> list[nn.Parameter]:
    """Free the storage of every parameter of ``model`` this pipeline rank does not train (the
    other stages' layers: the whole model is built on each rank, then cut), keeping the tensor
    objects; returns them, for :func:`restore_other_stages`. Without this each rank held the
    whole model's weights through the run (found by ``hybridpar train --dry-run``: at 405B,
    pp16, 16x a stage's parameters)."""
    keep = {id(q) for q in trained}
    released = [q for q in model.parameters() if id(q) not in keep and spans_whole_storage(q.data)]
    for q in released:
        free_storage(q.data)
    return released


def restore_other_stages(released: list[nn.Parameter]) -> None:
    """Give the parameters :func:`release_other_stages` freed their memory back (contents
    undefined: the caller fills them, e.g. by broadcasting each stage's weights)."""
    for q in released:
        restore_storage(q.data)
    released.clear()
