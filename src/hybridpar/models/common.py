"""Pieces several families share: RoPE tables (Llama-like families) and the metadata of packed
documents (every family: ``train.document_mask``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Documents", "apply_rope", "precompute_rope", "rotate_half", "segment_positions"]


# ----------------------------------------------------------------------------- RoPE


def precompute_rope(head_dim: int, positions: Tensor, theta: float) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each fp32 ``[len(positions), head_dim]``, for the given token positions.

    Positions are explicit (not ``arange``) so context parallelism can feed each rank its own,
    non-contiguous chunk of the sequence. Frequencies are duplicated across the two halves of
    the head, matching :func:`rotate_half`.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                              device=positions.device) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim (the HF convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, heads, T, head_dim]`` by the angles in ``cos``/``sin [T, head_dim]``.

    Done in fp32 and cast back, so bf16 runs do not lose precision in the rotation.
    """
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


# ----------------------------------------------------------------------------- documents


@dataclass(frozen=True)
class Documents:
    """Packed documents of a batch (``train.document_mask``): tokens attend only within their
    own document (block-causal) and RoPE positions restart at each document start.

    ``segments [B, T]`` (int64): a document label per token, equal labels = same document; labels
    must be consistent over a whole sequence (context parallelism compares the labels of
    different ranks' tokens). ``positions [B, T]`` (int64): each token's position within its
    document, the RoPE position. Both hold this rank's tokens in the order of ``tokens``.
    """

    segments: Tensor
    positions: Tensor

    @classmethod
    def from_segments(cls, segments: Tensor) -> Documents:
        """From per-token document labels ``[B, T]`` of whole (unsharded) sequences."""
        return cls(segments, segment_positions(segments))

    def index_select(self, dim: int, index: Tensor) -> Documents:
        """The tokens at ``index`` along ``dim`` (e.g. a context-parallel shard)."""
        return Documents(self.segments.index_select(dim, index), self.positions.index_select(dim, index))

    def to(self, device: torch.device | str) -> Documents:
        return Documents(self.segments.to(device), self.positions.to(device))

    def rope(self, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
        """``(cos, sin)`` ``[B, 1, T, head_dim]`` for the document-relative positions."""
        b, t = self.positions.shape
        cos, sin = precompute_rope(head_dim, self.positions.reshape(-1), theta)
        return cos.view(b, 1, t, head_dim), sin.view(b, 1, t, head_dim)

    def mask(self) -> Tensor:
        """Bool ``[B, 1, T, T]`` (True = visible): causal within the same document, for tokens in
        sequence order (no context-parallel sharding)."""
        t = self.segments.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=self.segments.device).tril_()
        return (causal & (self.segments[:, :, None] == self.segments[:, None, :])).unsqueeze(1)


def segment_positions(segments: Tensor) -> Tensor:
    """Position of each token within its run of equal labels along the last dim: ``[0, 0, 1, 1,
    1]`` -> ``[0, 1, 0, 1, 2]`` (a sequence's first token starts a run)."""
    t = segments.shape[-1]
    idx = torch.arange(t, device=segments.device).expand_as(segments)
    start = torch.ones_like(segments, dtype=torch.bool)
    start[..., 1:] = segments[..., 1:] != segments[..., :-1]
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - first
