"""Llama-style decoder: the math only, no parallelism.

Also the math of Qwen2 (``cfg.qkv_bias``: biases on the q/k/v projections), Qwen3
(``cfg.qk_norm``: a per-head RMSNorm on queries and keys before RoPE; ``cfg.kv_channels``: a head
size other than ``dim / n_heads``) and Mistral (Llama's layers); their folders hold their
Hugging Face mappings.

Parameter names and layouts follow Meta's reference code (``wq``, ``w1``, ``attention_norm``,
...) and map one-to-one onto Hugging Face ``LlamaForCausalLM`` names (:mod:`.hf`). RoPE
uses the HF ``rotate_half`` convention (first half of a head pairs with the second half), so HF
weights copy across with no permutation of ``wq``/``wk``.

Initial weights depend only on (seed, parameter name) through :func:`init_tensor`, so any
sharded layout can build the full tensor and keep its slice, and get the same model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.compat import scaled_dot_product_attention
from hybridpar.config import ModelConfig
from hybridpar.models.common import (
    Documents,
    apply_rope,
    init_tensor,
    precompute_rope,
    project,
    rotate_half,
    segment_positions,
)
from hybridpar.models.moe import AuxLossScale, MoE
from hybridpar.models.rope import check_rope_type

__all__ = [
    "Attention",
    "Block",
    "Documents",
    "FeedForward",
    "Llama",
    "RMSNorm",
    "apply_rope",
    "init_tensor",
    "precompute_rope",
    "rotate_half",
    "segment_positions",
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


# ----------------------------------------------------------------------------- layers


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query KV heads and RoPE; q/k/v biases with
    ``cfg.qkv_bias`` (Qwen2), per-head q/k RMSNorm before RoPE with ``cfg.qk_norm`` (Qwen3).

    The causal mask follows the order of the tokens in the input (local index), which is what
    a single sequence needs; ring attention supplies its own masking later.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, docs: Documents | None = None) -> Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q.transpose(1, 2), cos, sin), apply_rope(k.transpose(1, 2), cos, sin)
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
            return scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return scaled_dot_product_attention(q, k, v, attn_mask=docs.mask(), enable_gqa=gqa)


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
    """One pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + ffn(norm(x))``; the FFN is a
    mixture of experts (:class:`~hybridpar.models.moe.MoE`) in the layers ``cfg.moe_layer_ids()``
    names (Mixtral, Qwen3-MoE)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, aux_scale: AuxLossScale | None = None) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module
        if layer in cfg.moe_layer_ids():
            shared = FeedForward(cfg.dim, cfg.n_shared_experts * cfg.expert_hidden) if cfg.n_shared_experts else None
            self.feed_forward = MoE(cfg, aux_scale or AuxLossScale(), shared)
        else:
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
        self.rope_scaling = check_rope_type(cfg)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.moe_aux = AuxLossScale()  # MoE layers' auxiliary losses: backward scale and running value
        self.rope_dim = self.rope_dim_of(cfg)
        self.layers = nn.ModuleList(self.block(cfg, i, self.moe_aux) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = (
            None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        )

    #: the decoder layer (a family with Llama's decoder around other layers swaps it)
    block: type[nn.Module] = Block

    @staticmethod
    def rope_dim_of(cfg: ModelConfig) -> int:
        """The channels RoPE rotates (a head's)."""
        return cfg.head_dim

    def forward(self, tokens: Tensor, positions: Tensor | None = None,
                docs: Documents | None = None) -> Tensor:
        """Logits ``[B, T, vocab]`` for ``tokens [B, T]``; ``positions [T]`` defaults to arange.

        With ``docs`` (packed documents) attention stays within each document and RoPE uses
        ``docs.positions``; ``positions`` then only orders the tokens (context parallelism)."""
        if docs is not None:
            return self._forward_documents(tokens, docs.to(tokens.device))
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = precompute_rope(self.rope_dim, positions.to(tokens.device), self.cfg.rope_theta,
                                   self.rope_scaling)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.finish(self.norm(h), tokens, cos, sin)

    def _forward_documents(self, tokens: Tensor, docs: Documents) -> Tensor:
        cos, sin = docs.rope(self.rope_dim, self.cfg.rope_theta, self.rope_scaling)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, docs)
        return self.finish(self.norm(h), tokens, cos, sin, docs)

    def finish(self, h: Tensor, tokens: Tensor, cos: Tensor, sin: Tensor, docs: Documents | None = None) -> Tensor:
        """The logits of the final norm's output ``h`` (a family with extra heads on ``h``, such
        as DeepSeek-V3's multi-token prediction, adds them here)."""
        return project(h, self.output, self.tok_embeddings)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter from :func:`init_tensor`, on its own device and dtype."""
        for name, p in self.named_parameters():
            p.copy_(init_tensor(name, p.shape, seed, self.cfg))


