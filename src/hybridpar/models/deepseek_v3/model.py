"""DeepSeek-V3's decoder: the math only, no parallelism.

Llama's decoder (:class:`~hybridpar.models.llama.Llama`: embedding, pre-norm layers, final
norm, head) with three differences:

* **Multi-head latent attention** (:class:`MLAttention`). Queries: ``wq`` (``dim -> heads x
  (qk_nope + qk_rope)``), or with ``q_lora_rank`` the low-rank ``wq_b(q_norm(wq_a(x)))``.
  Keys and values: ``wkv_a`` compresses ``x`` to a ``kv_lora_rank`` latent (normed by
  ``kv_norm``) plus one ``qk_rope_head_dim`` RoPE key shared by every head; ``wkv_b`` expands
  the latent to each head's ``qk_nope_head_dim`` key part and ``v_head_dim`` value. A head's key
  is ``[k_nope, k_rope]``, its query ``[q_nope, q_rope]``; RoPE rotates only the rope parts
  (DeepSeek's checkpoints store those channels as interleaved pairs: ``cfg.rope_interleave``
  reorders them to halves first, which changes no dot product). The softmax scale is
  ``(qk_nope + qk_rope)^-1/2``, times ``mscale^2`` under yarn with ``mscale_all_dim`` (folded
  into the query, so the attention core is the generic one that context parallelism replaces).
  The core gets the values zero-padded to the query/key head size and returns them cut back
  (the same numbers): the fused attention kernels (the CPU's, the GPU's flash) take one head
  size for q, k and v, and without them torch's math path keeps the ``T x T`` probabilities for
  backward; the ring's and all-to-all's keys and values are then of one size too.
* **MoE layers** after the first ``first_k_dense_replace`` (= ``cfg.moe_layers``): sigmoid
  scores, group-limited top-k, ``routed_scaling_factor`` and shared experts, all in
  :class:`~hybridpar.models.moe.Router`/:class:`~hybridpar.models.moe.MoE`.
* **Multi-token prediction** (:class:`MTP`, DeepSeek-V3 section 2.2): module ``k`` (1..K) takes
  the previous depth's hidden state ``h`` (depth 0: the final norm's output, what the head
  sees) and the embedding of the token ``k`` places ahead, and returns
  ``norm(block(eh_proj([enorm(emb), hnorm(h)])))``, whose logits (the shared head) predict the
  token ``k + 1`` places ahead; transformers' ``MtpLayer`` is the same. Training adds
  ``mtp_loss_weight / K * sum_k CE_k`` (each the mean over the positions whose target lies in
  the sequence) through the gradient, as the MoE auxiliary losses are
  (:class:`~hybridpar.models.moe.AttachAuxLoss`); inference (no gradient) skips the modules, so
  the logits are the main model's. The loss under tp, cp and pp: :mod:`.mtp`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.config import ModelConfig
from hybridpar.distributed.mesh import Axis
from hybridpar.models.common import Documents, apply_rope, project
from hybridpar.models.deepseek_v3.mtp import attach_mtp_loss, mtp_loss
from hybridpar.models.llama.model import Attention, Block, FeedForward, Llama, RMSNorm
from hybridpar.models.moe import AuxLossScale, MoE

__all__ = ["MTP", "DeepseekV3", "MLABlock", "MLAttention", "softmax_mscale"]


def softmax_mscale(cfg: ModelConfig) -> float:
    """The factor on the softmax scale: yarn's ``(0.1 mscale_all_dim ln(factor) + 1)^2`` (1 when
    the factor is <= 1, the RoPE is not yarn, or no ``mscale_all_dim`` is set), as DeepSeek and
    transformers compute it."""
    if cfg.rope_type == "default" or not cfg.rope_mscale_all_dim or cfg.rope_factor <= 1:
        return 1.0
    return (0.1 * cfg.rope_mscale_all_dim * math.log(cfg.rope_factor) + 1.0) ** 2


def deinterleave(x: Tensor) -> Tensor:
    """``[x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...]`` over the last dim: interleaved
    RoPE pairs as the halves :func:`~hybridpar.models.common.apply_rope` rotates."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class MLAttention(nn.Module):
    """Multi-head latent attention (module doc). ``n_heads`` is this rank's head count (the
    tensor-parallel plan divides it); ``core`` is :class:`~hybridpar.models.llama.Attention`'s."""

    core = Attention.core

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = self.n_kv_heads = cfg.n_heads  # one latent key/value per head
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank, self.interleave = cfg.kv_lora_rank, cfg.rope_interleave
        qk = (self.nope + self.rope) * cfg.n_heads
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, qk, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_lora_rank, cfg.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.v_dim, cfg.dim, bias=False)
        self.q_scale = softmax_mscale(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, docs: Documents | None = None) -> Tensor:
        b, t, _ = x.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if hasattr(self, "wq_a") else self.wq(x)
        q = q.view(b, t, -1, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, t, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_rope = k_rope.view(b, 1, t, self.rope)
        if self.interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        q = torch.cat((q_nope, q_rope), dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        pad = q.shape[-1] - self.v_dim  # the fused kernels and the parallel cores take one head size
        v = F.pad(v, (0, pad)) if pad > 0 else v.contiguous()
        out = self.core(q, k, v) if docs is None else self.core(q, k, v, docs)
        out = out[..., : self.v_dim] if pad > 0 else out
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class MLABlock(Block):
    """Llama's pre-norm decoder layer with :class:`MLAttention`; the FFN a mixture of experts
    in the MoE layers (and, with ``moe``, always: the multi-token prediction modules')."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, aux_scale: AuxLossScale | None = None,
                 moe: bool | None = None) -> None:
        nn.Module.__init__(self)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = MLAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module
        if (layer in cfg.moe_layer_ids()) if moe is None else moe:
            shared = FeedForward(cfg.dim, cfg.n_shared_experts * cfg.expert_hidden) if cfg.n_shared_experts else None
            self.feed_forward = MoE(cfg, aux_scale or AuxLossScale(), shared)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)


class DeepseekV3(Llama):
    """Llama's decoder of :class:`MLABlock` layers, RoPE over ``qk_rope_head_dim`` channels, and
    ``cfg.mtp_layers`` multi-token prediction modules (``mtp``) whose losses training adds."""

    block = MLABlock

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.mtp = nn.ModuleList(MTP(cfg, self.moe_aux) for _ in range(cfg.mtp_layers))
        # where the heads' input (the final norm's and each module's output) enters the tp
        # region: the tp plan hooks this rather than the final norm, whose output the modules
        # read outside the region, as a decoder layer reads its input
        self.head_in = nn.Identity()
        self.mtp_tp: Axis | None = None  # the heads' vocab-parallel axis (the tp plan sets it)

    @staticmethod
    def rope_dim_of(cfg: ModelConfig) -> int:
        return cfg.qk_rope_head_dim

    def finish(self, h: Tensor, tokens: Tensor, cos: Tensor, sin: Tensor, docs: Documents | None = None) -> Tensor:
        """The logits of ``h``; in training, with the multi-token prediction losses attached
        (:func:`~hybridpar.models.deepseek_v3.mtp.attach_mtp_loss`)."""
        h = attach_mtp_loss(self, h, tokens, cos, sin, docs)
        return project(self.head_in(h), self.output, self.tok_embeddings)

    def mtp_loss(self, h: Tensor, tokens: Tensor, cos: Tensor, sin: Tensor, docs: Documents | None = None) -> Tensor:
        """``mtp_loss_weight / K * sum_k CE_k`` of the modules on ``tokens [B, T]`` and the final
        norm's output ``h`` (:func:`~hybridpar.models.deepseek_v3.mtp.mtp_loss`)."""
        return mtp_loss(self, h, tokens, cos, sin, docs)


class MTP(nn.Module):
    """One multi-token prediction module (module doc): ``enorm``/``hnorm``, ``eh_proj`` (``[2 dim
    -> dim]``), a decoder layer (a mixture of experts when the model has experts, as in
    DeepSeek-V3) and its output ``norm``; the embedding and head are the model's."""

    def __init__(self, cfg: ModelConfig, aux_scale: AuxLossScale) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = MLABlock(cfg, aux_scale=aux_scale, moe=cfg.n_experts > 0)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, h: Tensor, emb: Tensor, cos: Tensor, sin: Tensor, docs: Documents | None = None) -> Tensor:
        """This depth's hidden state from the previous depth's ``h`` and the embeddings ``emb``."""
        x = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(h)), dim=-1))
        return self.norm(self.block(x, cos, sin) if docs is None else self.block(x, cos, sin, docs))
