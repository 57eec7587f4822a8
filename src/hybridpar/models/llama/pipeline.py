"""Llama's pipeline chunk: embedding (first chunk only), a contiguous run of decoder layers,
and norm + head (last chunk only), sharing the model's parameters under the model's names.

RoPE ``cos``/``sin`` are recomputed in each chunk from the positions (cheap, and nothing but the
hidden state crosses a stage boundary). The generic half (which chunks a rank runs, tied
embeddings) is :mod:`hybridpar.parallel.pipeline.stages`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.models.llama.model import Documents, Llama, precompute_rope
from hybridpar.parallel.pipeline.partition import ChunkSpec

__all__ = ["LlamaChunk"]



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

    def embedding_weight(self) -> Tensor:
        """The (tied) embedding weight this chunk uses, read now (ZeRO-3 swaps parameters)."""
        return self.tok_embeddings.weight

    def _head(self, x: Tensor) -> Tensor:
        x = self.norm(x)
        if self.output is None:
            return F.linear(x, self.tok_embeddings.weight)
        return self.output(x)

