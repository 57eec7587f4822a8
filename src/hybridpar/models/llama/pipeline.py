"""Llama's pipeline chunk: embedding (first chunk only), a contiguous run of decoder layers,
and norm + head (last chunk only), sharing the model's parameters under the model's names.

RoPE ``cos``/``sin`` are recomputed in each chunk from the positions (cheap, and nothing but the
hidden state crosses a stage boundary). The generic half (which chunks a rank runs, tied
embeddings) is :mod:`hybridpar.parallel.pipeline.stages`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hybridpar.models.common import DecoderChunk
from hybridpar.models.llama.model import Documents, Llama, precompute_rope
from hybridpar.parallel.pipeline.partition import ChunkSpec

__all__ = ["LlamaChunk"]



class LlamaChunk(DecoderChunk):
    """Embedding (first chunk only), a contiguous run of decoder layers, and norm + head (last
    chunk only) of a :class:`Llama`, sharing its parameters; RoPE from the positions."""

    def __init__(self, model: Llama, spec: ChunkSpec) -> None:
        super().__init__(model, spec)
        self.head_dim = model.rope_dim
        self.rope_theta = model.cfg.rope_theta
        self.rope_scaling = model.cfg

    def forward(self, x: Tensor, positions: Tensor | None = None, docs: Documents | None = None,
                tokens: Tensor | None = None) -> Tensor:
        """Tokens ``[B, T]`` (first chunk) or hidden ``[B, T, dim]`` -> hidden, or logits
        ``[B, T, vocab]`` (last chunk). ``docs``: the micro-batch's packed documents (every
        stage gets them from the runner; RoPE then uses their positions). ``tokens``: the
        micro-batch's input ids, for a last chunk that ``reads_tokens`` (:meth:`finish`)."""
        if docs is not None:
            return self._forward_documents(x, docs.to(x.device), tokens)
        if positions is None:
            positions = self.positions
        if positions is None:
            length = x.shape[1] if self.spec.embedding else x.shape[1] * self.sequence_shards
            positions = torch.arange(length, device=x.device)
        if self.spec.embedding:
            x = self.tok_embeddings(x)
        cos, sin = precompute_rope(self.head_dim, positions.to(x.device), self.rope_theta, self.rope_scaling)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        if not self.spec.head:
            return x
        return self.finish(x, tokens, cos, sin)

    def _forward_documents(self, x: Tensor, docs: Documents, tokens: Tensor | None) -> Tensor:
        if self.spec.embedding:
            x = self.tok_embeddings(x)
        cos, sin = docs.rope(self.head_dim, self.rope_theta, self.rope_scaling)
        for layer in self.layers.values():
            x = layer(x, cos, sin, docs)
        return self.finish(x, tokens, cos, sin, docs) if self.spec.head else x
