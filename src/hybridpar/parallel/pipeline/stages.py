"""Cut :class:`~hybridpar.models.llama.Llama` into pipeline chunks without touching its code.

A :class:`LlamaChunk` wraps the model's own submodules (``tok_embeddings``, ``layers[i]``,
``norm``, ``output``), so its parameters *are* the model's parameters, under the model's names
(``layers.3.attention.wq.weight``): optimizer, checkpoints and gradient comparisons work by
name. The first chunk takes token ids, the others hidden states; the last one returns logits.
RoPE ``cos``/``sin`` are recomputed in each chunk from the positions (cheap, and nothing but the
hidden state crosses a stage boundary).

Tied embeddings (``cfg.tie_embeddings``): the head reuses ``tok_embeddings.weight``. With
``pp > 1`` the first and last stage sit on different ranks, so each holds its own copy (same
initial values); after every backward the trainer must sum the two copies' gradients
(:func:`sync_tied_embedding_grads`, an exchange between pp ranks 0 and pp-1 through the comm
layer) before clipping and the optimizer step. Both copies then see the same gradient and the
same optimizer state, so they stay identical. With pp = 1 it is one parameter and nothing is needed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.distributed.mesh import Topology
from hybridpar.models.llama import Documents, Llama, precompute_rope
from hybridpar.parallel.pipeline.partition import ChunkSpec, Partition, partition_model


class LlamaChunk(nn.Module):
    """Embedding (first chunk only), a contiguous run of decoder layers, and norm + head (last
    chunk only) of a :class:`Llama`, sharing its parameters."""

    def __init__(self, model: Llama, spec: ChunkSpec) -> None:
        super().__init__()
        self.spec = spec
        self.head_dim = model.cfg.head_dim
        self.rope_theta = model.cfg.rope_theta
        self.tied = model.output is None
        self.tok_embeddings = model.tok_embeddings if spec.embedding or (spec.head and self.tied) else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in spec.layers})
        self.norm = model.norm if spec.head else None
        self.output = model.output if spec.head else None
        # Hidden states arriving from the previous stage are split along the sequence in this
        # many parts (tensor parallelism with sequence parallelism): RoPE needs full positions.
        self.sequence_shards = 1
        # Original token positions of this rank's tokens when they are not 0..T-1 (context
        # parallelism's zigzag shards); None means arange.
        self.positions: Tensor | None = None

    def forward(self, x: Tensor, positions: Tensor | None = None, docs: Documents | None = None) -> Tensor:
        """Tokens ``[B, T]`` (first chunk) or hidden ``[B, T, dim]`` -> hidden, or logits
        ``[B, T, vocab]`` (last chunk). ``docs``: the micro-batch's packed documents (every
        stage gets them from the runner; RoPE then uses their positions)."""
        if docs is not None:
            return self._forward_documents(x, docs.to(x.device))
        if positions is None:
            positions = self.positions
        if positions is None:
            length = x.shape[1] if self.spec.embedding else x.shape[1] * self.sequence_shards
            positions = torch.arange(length, device=x.device)
        if self.spec.embedding:
            x = self.tok_embeddings(x)
        cos, sin = precompute_rope(self.head_dim, positions.to(x.device), self.rope_theta)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if not self.spec.head:
            return x
        return self._head(x)

    def _forward_documents(self, x: Tensor, docs: Documents) -> Tensor:
        if self.spec.embedding:
            x = self.tok_embeddings(x)
        cos, sin = docs.rope(self.head_dim, self.rope_theta)
        for layer in self.layers.values():
            x = layer(x, cos, sin, docs)
        return self._head(x) if self.spec.head else x

    def _head(self, x: Tensor) -> Tensor:
        x = self.norm(x)
        if self.output is None:
            return F.linear(x, self.tok_embeddings.weight)
        return self.output(x)


def build_stage_modules(model: Llama, pp_rank: int, pp: int, virtual_stages: int = 1,
                        partition: Partition | None = None) -> list[LlamaChunk]:
    """The chunks pipeline rank ``pp_rank`` runs, in local-chunk order (chunk v is global stage
    ``v * pp + pp_rank``). ``partition`` defaults to equal layer counts."""
    if partition is None:
        partition = partition_model(model.cfg, pp, virtual_stages)
    if (partition.pp, partition.virtual_stages) != (pp, virtual_stages):
        raise ValueError(f"partition is for pp={partition.pp} V={partition.virtual_stages}, "
                         f"not pp={pp} V={virtual_stages}")
    return [LlamaChunk(model, spec) for spec in partition.for_rank(pp_rank)]


def tied_embedding_weight(chunks: list[LlamaChunk]) -> Tensor | None:
    """This rank's copy of the tied embedding weight if it is used at both ends of the model
    and this rank holds exactly one end (first or last stage); None otherwise."""
    ends = [c for c in chunks if c.tied and (c.spec.embedding or c.spec.head)]
    if not ends:
        return None
    if any(c.spec.embedding for c in ends) and any(c.spec.head for c in ends):
        return None  # both ends on this rank (pp = 1): one parameter, autograd sums both uses
    return ends[0].tok_embeddings.weight


def owned_named_parameters(chunks: list[LlamaChunk]) -> list[tuple[str, nn.Parameter]]:
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
def sync_tied_embedding_grads(chunks: list[LlamaChunk], topo: Topology) -> None:
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
