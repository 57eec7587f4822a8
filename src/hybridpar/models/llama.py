"""Llama-style decoder: the math only, no parallelism.

Parameter names and layouts follow Meta's reference code (``wq``, ``w1``, ``attention_norm``,
...) and map one-to-one onto Hugging Face ``LlamaForCausalLM`` names via :func:`hf_key`. RoPE
uses the HF ``rotate_half`` convention (first half of a head pairs with the second half), so HF
weights copy across with no permutation of ``wq``/``wk``.

Initial weights depend only on (seed, parameter name) through :func:`init_tensor`, so any
sharded layout can build the full tensor and keep its slice, and get the same model.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.config import ModelConfig

__all__ = [
    "Attention",
    "Block",
    "Documents",
    "FeedForward",
    "Llama",
    "RMSNorm",
    "apply_rope",
    "from_hf_key",
    "hf_key",
    "init_tensor",
    "precompute_rope",
    "rotate_half",
    "segment_positions",
    "to_hf_config_dict",
]


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale, computed in fp32 and cast back (as HF does)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


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


# ----------------------------------------------------------------------------- layers


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query KV heads and RoPE, no biases.

    The causal mask follows the order of the tokens in the input (local index), which is what
    a single sequence needs; ring attention supplies its own masking later.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, docs: Documents | None = None) -> Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v) if docs is None else self.core(q, k, v, docs)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))

    def core(self, q: Tensor, k: Tensor, v: Tensor, docs: Documents | None = None) -> Tensor:
        """``softmax(q k^T / sqrt(d) + causal mask) v`` for ``[B, heads, T, head_dim]`` inputs:
        the attention core (what context parallelism replaces and selective recompute reruns).
        With ``docs`` the mask is block-causal: causal and within the same document."""
        # enable_gqa broadcasts KV heads inside the kernel: no repeated copies, and measured
        # faster than repeat_interleave on CPU. Head counts come from the tensors, so a
        # tensor-parallel shard with fewer local heads works unchanged.
        gqa = q.shape[1] != k.shape[1]
        if docs is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=docs.mask(), enable_gqa=gqa)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``, no biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + ffn(norm(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, docs: Documents | None = None) -> Tensor:
        h = self.attention_norm(x)
        x = x + (self.attention(h, cos, sin) if docs is None else self.attention(h, cos, sin, docs))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Token embedding, ``n_layers`` blocks, final norm and output head.

    With ``cfg.tie_embeddings`` there is no ``output`` layer (it is ``None``) and the logits
    reuse ``tok_embeddings.weight``, so the parameter count matches ``cfg.num_params()``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = (
            None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        )

    def forward(self, tokens: Tensor, positions: Tensor | None = None,
                docs: Documents | None = None) -> Tensor:
        """Logits ``[B, T, vocab]`` for ``tokens [B, T]``; ``positions [T]`` defaults to arange.

        With ``docs`` (packed documents) attention stays within each document and RoPE uses
        ``docs.positions``; ``positions`` then only orders the tokens (context parallelism)."""
        if docs is not None:
            return self._forward_documents(tokens, docs.to(tokens.device))
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = precompute_rope(self.cfg.head_dim, positions.to(tokens.device), self.cfg.rope_theta)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        h = self.norm(h)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    def _forward_documents(self, tokens: Tensor, docs: Documents) -> Tensor:
        cos, sin = docs.rope(self.cfg.head_dim, self.cfg.rope_theta)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, docs)
        h = self.norm(h)
        if self.output is None:
            return F.linear(h, self.tok_embeddings.weight)
        return self.output(h)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter from :func:`init_tensor`, on its own device and dtype."""
        for name, p in self.named_parameters():
            p.copy_(init_tensor(name, p.shape, seed, self.cfg))


# ----------------------------------------------------------------------------- init


def _name_seed(seed: int, name: str) -> int:
    """A stable 63-bit seed from (seed, name): sha256, not ``hash()``, which is salted per process."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_tensor(name: str, shape: Sequence[int], seed: int, cfg: ModelConfig) -> Tensor:
    """The full fp32 CPU initial value of parameter ``name`` (our naming), a pure function.

    Norm weights are ones; every other weight is normal(0, 0.02), with the residual output
    projections (``wo``, ``w2``) scaled by ``1/sqrt(2 * n_layers)`` (GPT-2 style) so the
    residual stream's variance does not grow with depth. Each parameter has its own generator,
    so the values never depend on creation order, layer count or layout.
    """
    shape = tuple(int(s) for s in shape)
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = 0.02
    if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
        std /= math.sqrt(2 * cfg.n_layers)
    gen = torch.Generator(device="cpu").manual_seed(_name_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


# ----------------------------------------------------------------------------- Hugging Face

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_INV = {v: k for k, v in _TOP.items()}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_OURS_RE = re.compile(r"layers\.(\d+)\.(.+)\.weight")
_HF_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")


def hf_key(name: str) -> str:
    """Our parameter name -> HF ``LlamaForCausalLM`` state-dict key (KeyError if unknown)."""
    if name in _TOP:
        return _TOP[name]
    m = _OURS_RE.fullmatch(name)
    if m is None or m.group(2) not in _LAYER:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight"


def from_hf_key(key: str) -> str:
    """HF ``LlamaForCausalLM`` state-dict key -> our parameter name (KeyError if unknown)."""
    if key in _TOP_INV:
        return _TOP_INV[key]
    m = _HF_RE.fullmatch(key)
    if m is None or m.group(2) not in _LAYER_INV:
        raise KeyError(f"no hybridpar name for Hugging Face key {key!r}")
    return f"layers.{m.group(1)}.{_LAYER_INV[m.group(2)]}.weight"


def to_hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """Keyword arguments for ``transformers.LlamaConfig(**d)`` describing the same model.

    ``rope_theta`` is given both flat (transformers 4.x) and as ``rope_parameters`` (5.x).
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": 0.02,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
    }
