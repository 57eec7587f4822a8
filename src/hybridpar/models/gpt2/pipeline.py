"""GPT-2's pipeline chunk: token + position embeddings (first chunk only), a contiguous run of
layers, and final LayerNorm + head (last chunk only), sharing the model's parameters under the
model's names. The generic half (which chunks a rank runs, tied embeddings) is
:mod:`hybridpar.parallel.pipeline.stages`.

Only the first chunk needs positions (to look up the learned position embeddings; under
sequence parallelism the parallel plan's hook on ``pos_embeddings`` keeps this rank's shard);
later chunks get hidden states that already carry them, so ``sequence_shards`` is unused.
"""

from __future__ import annotations

from torch import Tensor

from hybridpar.models.common import DecoderChunk
from hybridpar.models.gpt2.model import GPT2, Documents, embed
from hybridpar.parallel.pipeline.partition import ChunkSpec

__all__ = ["GPT2Chunk"]


class GPT2Chunk(DecoderChunk):
    """Embeddings (first chunk only: tokens and learned positions), a contiguous run of layers,
    and norm + head (last chunk only) of a :class:`GPT2`, sharing its parameters. Hidden states
    from the previous stage already hold their positions; ``positions`` is read by the first
    chunk only."""

    def __init__(self, model: GPT2, spec: ChunkSpec) -> None:
        super().__init__(model, spec)
        self.pos_embeddings = model.pos_embeddings if spec.embedding else None

    def forward(self, x: Tensor, positions: Tensor | None = None, docs: Documents | None = None) -> Tensor:
        """Tokens ``[B, T]`` (first chunk) or hidden ``[B, T, dim]`` -> hidden, or logits
        ``[B, T, vocab]`` (last chunk). ``docs``: the micro-batch's packed documents (every
        stage gets them: the mask; the first chunk also their positions)."""
        if docs is not None:
            docs = docs.to(x.device)
        if self.spec.embedding:
            x = embed(self.tok_embeddings, self.pos_embeddings, x,
                      positions if positions is not None else self.positions, docs)
        for layer in self.layers.values():
            x = layer(x) if docs is None else layer(x, docs)
        if not self.spec.head:
            return x
        return self.head(x)

