"""GPT-2 (Radford et al. 2019): the math only, no parallelism.

Pre-norm decoder layers with LayerNorm (weight and bias, ``cfg.norm_eps`` = HF's
``layer_norm_epsilon``), multi-head attention with biases on q/k/v and the output projection,
a two-matrix MLP with biases and the tanh-approximated GELU (HF's ``gelu_new``), learned
absolute position embeddings added to the token embeddings, a final LayerNorm and the head
tied to the token embedding (``cfg.tie_embeddings``; untied heads work as in Llama). No RoPE.

Differences from Hugging Face's ``GPT2LMHeadModel`` that do not change the function:

* q, k and v are three ``nn.Linear`` layers (``attention.wq/wk/wv``), not one fused Conv1D
  ``c_attn``; every Conv1D weight (``[in, out]``) is stored as an ``nn.Linear`` weight
  (``[out, in]``). :mod:`.hf` splits and transposes on import and fuses back on export. Separate
  projections make tensor parallelism exact with a plain row split: each of q, k and v is
  split by heads on its own, where a row split of the fused ``[3 * dim, dim]`` matrix would
  hand rank 0 all of q and half of k.
* No dropout: hybridpar trains without it (``resid_pdrop``/``embd_pdrop``/``attn_pdrop`` of a
  Hugging Face config are ignored), which equals HF's model in eval mode.

Parameter names follow the Llama family's (``tok_embeddings``, ``layers.N.attention.wq``,
``feed_forward.w1``/``w2``, ``attention_norm``/``ffn_norm``, ``norm``) plus ``pos_embeddings``,
so generic code that knows ``tok_embeddings`` (tied pipeline ends) works unchanged.

Initial weights depend only on (seed, parameter name) through :func:`init_tensor`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.compat import scaled_dot_product_attention
from hybridpar.config import ConfigError, ModelConfig
from hybridpar.models.common import Documents, init_tensor, project
from hybridpar.rules import model_error

__all__ = ["GPT2", "Attention", "Block", "Documents", "FeedForward", "check_config", "embed", "head",
           "init_tensor"]


def check_config(cfg: ModelConfig) -> None:
    """:class:`ConfigError` (one line) for a shape GPT-2 cannot have (one KV head per query
    head, head size ``dim / n_heads``, no per-head q/k norms): the ``model-*`` rules of
    :mod:`hybridpar.rules`, which ``validate`` applies before any process starts."""
    message = model_error(cfg)
    if message is not None:
        raise ConfigError(message)


class Attention(nn.Module):
    """Causal multi-head attention, biases on every projection, no position encoding (the
    positions were added to the embeddings)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim)
        self.wk = nn.Linear(cfg.dim, cfg.dim)
        self.wv = nn.Linear(cfg.dim, cfg.dim)
        self.wo = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: Tensor, docs: Documents | None = None) -> Tensor:
        b, t, _ = x.shape
        # head counts come from the tensors: a tensor-parallel shard has fewer local heads
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        out = self.core(q, k, v) if docs is None else self.core(q, k, v, docs)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))

    def core(self, q: Tensor, k: Tensor, v: Tensor, docs: Documents | None = None) -> Tensor:
        """``softmax(q k^T / sqrt(d) + causal mask) v`` for ``[B, heads, T, head_dim]`` inputs
        (what context parallelism replaces and selective recompute reruns); with ``docs`` the
        mask is block-causal (causal and within the same document)."""
        if docs is None:
            return scaled_dot_product_attention(q, k, v, is_causal=True)
        return scaled_dot_product_attention(q, k, v, attn_mask=docs.mask())


class FeedForward(nn.Module):
    """``w2(gelu_tanh(w1 x))``, with biases (HF's ``mlp.c_fc``/``mlp.c_proj``)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    """One pre-norm layer: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: Tensor, docs: Documents | None = None) -> Tensor:
        h = self.attention_norm(x)
        x = x + (self.attention(h) if docs is None else self.attention(h, docs))
        return x + self.feed_forward(self.ffn_norm(x))


def embed(tok_embeddings: nn.Module, pos_embeddings: nn.Module, tokens: Tensor,
          positions: Tensor | None, docs: Documents | None) -> Tensor:
    """``tok(tokens) + pos(positions)``: ``docs.positions`` (restarting at every document)
    with packed documents, else ``positions`` (context parallelism's zigzag positions), else
    ``0..T-1``. Under sequence parallelism both terms are this rank's sequence shard (the
    parallel plan hooks ``pos_embeddings``)."""
    if docs is not None:
        positions = docs.positions
    elif positions is None:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
    return tok_embeddings(tokens) + pos_embeddings(positions.to(tokens.device))


def head(norm: nn.Module, output: nn.Module | None, tok_embeddings: nn.Module, h: Tensor) -> Tensor:
    """Logits: the final LayerNorm, then the tied embedding (or the untied ``output``)."""
    return project(norm(h), output, tok_embeddings)


class GPT2(nn.Module):
    """Token and position embeddings, ``n_layers`` blocks, final LayerNorm and the head.

    With ``cfg.tie_embeddings`` (GPT-2's own choice) ``output`` is ``None`` and the logits reuse
    ``tok_embeddings.weight``; the parameter count equals ``cfg.num_params()``.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        check_config(cfg)
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = (
            None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        )

    def forward(self, tokens: Tensor, positions: Tensor | None = None,
                docs: Documents | None = None) -> Tensor:
        """Logits ``[B, T, vocab]`` for ``tokens [B, T]``; ``positions [T]`` (the tokens' places
        in their sequences) default to ``0..T-1``. With ``docs`` (packed documents) attention
        stays within each document and the position embedding uses ``docs.positions``."""
        if docs is not None:
            docs = docs.to(tokens.device)
        h = embed(self.tok_embeddings, self.pos_embeddings, tokens, positions, docs)
        for layer in self.layers:
            h = layer(h) if docs is None else layer(h, docs)
        return head(self.norm, self.output, self.tok_embeddings, h)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Fill every parameter from :func:`init_tensor`, on its own device and dtype."""
        for name, p in self.named_parameters():
            p.copy_(init_tensor(name, p.shape, seed, self.cfg))
