"""Mixture-of-experts feed-forward: the math only (Mixtral, Qwen3-MoE and ``tiny-moe`` use it).

A token's FFN output is ``sum_{e in topk} w_e * expert_e(x) (+ shared experts(x))``:

* **Router** (:class:`Router`): ``logits = x W_r^T`` (``[N, E]``), scores ``softmax`` or
  ``sigmoid`` of them (fp32), the top ``k`` experts by score (plus the balancing bias, when
  ``cfg.bias_update_rate > 0``: DeepSeek-V3's auxiliary-loss-free balancing; the bias only
  chooses, it never weights), weights = the chosen scores, renormalised to sum 1 with
  ``cfg.norm_topk_prob``.
* **Experts** (:class:`Experts`): ``E`` SwiGLU MLPs stored stacked (``w1``/``w3`` ``[E, H, D]``,
  ``w2`` ``[E, D, H]``), run as grouped matmuls over the tokens sorted by expert. Dropless.
* **Losses**, per MoE layer and micro-batch over its ``N`` tokens (every token of the micro-batch,
  whatever the layout): load balancing (Switch Transformer / GShard)
  ``aux_loss_coef * E * sum_e f_e * P_e`` with ``f_e`` the fraction of the ``N k`` routed slots
  that chose ``e`` and ``P_e`` the mean over tokens of the (sum-normalised) score of ``e``; router
  z-loss (ST-MoE) ``z_loss_coef * mean(logsumexp(logits)^2)``. They are added to the training
  loss through the gradient (:class:`AttachAuxLoss`), so a pipeline stage needs no extra output;
  the language-model loss the trainer reports excludes them (``metrics.jsonl`` ``aux_loss``).
* **Bias balancing**: after each optimizer step ``bias_e += rate * sign(mean_load - load_e)``
  with the step's load over all tokens (:func:`update_balance_bias`).

Parallel layouts change none of this: the parallel plan gives the router a way to sum its
counts over the ranks that share a micro-batch's tokens (``Router.sum_counts``) and how many
such ranks split them (``Router.token_share``), and replaces ``experts`` with
:class:`hybridpar.parallel.experts.ExpertParallel`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hybridpar.compat import in_backward, is_fake
from hybridpar.config import ModelConfig
from hybridpar.parallel.experts import combine, sort_by_expert, swiglu_experts

__all__ = ["AttachAuxLoss", "AuxLossScale", "Experts", "MoE", "Router", "moe_layers", "update_balance_bias"]


class AuxLossScale:
    """What the engine multiplies this micro-batch's loss by in backward (``1 / M`` times the
    fp16 loss scale): the auxiliary losses get the same factor. One per model, shared by its
    MoE layers; also sums the auxiliary losses' values for logging."""

    def __init__(self) -> None:
        self.grad_scale = 1.0
        self.value: float | Tensor = 0.0  # sum of the auxiliary losses since reset (forward passes; fp64, on the device)
        self.count = 0  # micro-batches x MoE layers behind ``value``

    def reset(self) -> None:
        self.value, self.count = 0.0, 0


class AttachAuxLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also starts ``aux``'s backward with gradient
    ``scale.grad_scale``: ``aux`` is then part of the loss without being returned (Megatron's
    MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, aux: Tensor, scale: AuxLossScale) -> Tensor:
        ctx.scale, ctx.aux_shape = scale, aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor, Tensor, None]:
        grad = torch.full(ctx.aux_shape, ctx.scale.grad_scale, dtype=torch.float32, device=dy.device)
        return dy, grad, None


class Router(nn.Module):
    """Top-k router with the auxiliary losses and the balancing bias (module doc)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.k = cfg.n_experts, cfg.experts_per_token
        self.score, self.norm_topk = cfg.router_score, cfg.norm_topk_prob
        self.aux_coef, self.z_coef, self.seq_coef = cfg.aux_loss_coef, cfg.z_loss_coef, cfg.seq_aux_loss_coef
        self.n_group, self.topk_group, self.scaling = cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim))
        # the balancing bias is state (saved, never trained); the load is this step's statistics
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts), persistent=cfg.bias_update_rate > 0)
        self.register_buffer("load", torch.zeros(cfg.n_experts, dtype=torch.float64), persistent=False)
        self.use_bias = cfg.bias_update_rate > 0
        #: counts of this rank's tokens -> counts of all the micro-batch's tokens (parallel plan)
        self.sum_counts: Callable[[Tensor], Tensor] = lambda c: c
        #: ranks whose token sets add up to one share of the micro-batch (tp under SP)
        self.token_share = 1

    def forward(self, x: Tensor, batch: int = 1) -> tuple[Tensor, Tensor, Tensor | None]:
        """``(weights [N, k] in x's dtype, expert ids [N, k], auxiliary loss or None)`` for ``x [N, D]``
        (``batch`` sequences of ``N / batch`` tokens each, for the sequence-wise loss)."""
        logits = F.linear(x, self.weight).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        choose = scores + self.expert_bias if self.use_bias else scores
        if self.n_group > 1:
            choose = self._within_groups(choose)
        idx = choose.topk(self.k, dim=-1).indices
        if is_fake(idx):  # the dry run: no scores to rank; token i's slots go to experts i*k, ... (mod E), evenly
            idx = (torch.arange(idx.numel(), device=idx.device) % self.n_experts).view_as(idx)
        weights = scores.gather(1, idx)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.score == "sigmoid" else 0.0))
        if self.scaling != 1.0:
            weights = weights * self.scaling
        counts = (torch.zeros(self.n_experts, dtype=torch.int64, device=idx.device) if is_fake(idx)  # dry run
                  else torch.bincount(idx.reshape(-1), minlength=self.n_experts))
        if torch.is_grad_enabled() and not in_backward():  # training forwards, once (not a recompute)
            self.load += counts
        aux = self._aux_loss(logits, scores, counts, x.shape[0])
        if self.seq_coef and torch.is_grad_enabled():
            seq = self._sequence_loss(scores, idx, batch)
            aux = seq if aux is None else aux + seq
        return weights.to(x.dtype), idx, aux

    def _within_groups(self, choose: Tensor) -> Tensor:
        """DeepSeek-V3's group-limited routing: the experts outside each token's ``topk_group``
        best groups (a group's score: the sum of its two best experts') masked to ``-inf``."""
        n, g = choose.shape[0], self.n_group
        grouped = choose.view(n, g, self.n_experts // g)
        best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.topk_group, -1).indices, True)
        return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(n, -1)

    def _sequence_loss(self, scores: Tensor, idx: Tensor, batch: int) -> Tensor:
        """DeepSeek-V3's sequence-wise balance loss, this rank's share: per sequence
        ``seq_coef * sum_e f_e P_e`` with ``f_e = E / (k T)`` x the slots of the sequence's ``T``
        tokens that chose ``e`` and ``P_e`` the mean over them of the sum-normalised score of
        ``e``; averaged over the sequences (counts summed over the ranks sharing a sequence)."""
        n, e = scores.shape
        t_local = n // batch
        counts = torch.zeros(batch, e, device=scores.device).scatter_add_(
            1, idx.view(batch, -1), torch.ones(batch, t_local * self.k, device=scores.device))
        total = self.sum_counts(counts)
        f = total * e / total.sum(-1, keepdim=True)  # = E / (k T) x slot counts
        probs = (scores / scores.sum(-1, keepdim=True)).view(batch, t_local, e).sum(1)
        t = t_local * self.token_share
        return self.seq_coef * (f * probs).sum() / (t * batch)

    def _aux_loss(self, logits: Tensor, scores: Tensor, counts: Tensor, n_local: int) -> Tensor | None:
        """This rank's share of the micro-batch's auxiliary losses (its tokens' terms over all the
        micro-batch's tokens; the slot fractions ``f`` counted over all of them)."""
        if not (self.aux_coef or self.z_coef) or not torch.is_grad_enabled():
            return None
        n = n_local * self.token_share  # tokens of this rank's share of the micro-batch
        aux = logits.new_zeros(())
        if self.aux_coef:
            total = self.sum_counts(counts.to(torch.float32))
            f = total / total.sum()
            probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
            aux = aux + self.aux_coef * self.n_experts * (f * probs.sum(0)).sum() / n
        if self.z_coef:
            aux = aux + self.z_coef * torch.logsumexp(logits, -1).pow(2).sum() / n
        return aux


class Experts(nn.Module):
    """``E`` stacked SwiGLU experts (module doc); ``forward`` takes the router's choices."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, d = cfg.n_experts, cfg.expert_hidden, cfg.dim
        self.n_experts = e
        self.w1 = nn.Parameter(torch.empty(e, h, d))  # gate
        self.w3 = nn.Parameter(torch.empty(e, h, d))  # up
        self.w2 = nn.Parameter(torch.empty(e, d, h))  # down

    def forward(self, x: Tensor, weights: Tensor, idx: Tensor) -> Tensor:
        """``x [B, T, D]``, ``weights``/``idx`` ``[B, T, k]`` -> ``[B, T, D]``."""
        b, t, d = x.shape
        k = idx.shape[-1]
        flat = x.reshape(-1, d)
        order, token, counts = sort_by_expert(idx.reshape(-1, k), self.n_experts)
        y = swiglu_experts(flat[token], counts, self.w1, self.w3, self.w2)
        return combine(y, weights.reshape(-1, k), order, token, flat.shape[0]).view(b, t, d).to(x.dtype)


class MoE(nn.Module):
    """The MoE feed-forward of one layer: router, routed experts, optional shared experts
    (``shared``: a dense MLP of ``n_shared_experts * H`` run on every token)."""

    def __init__(self, cfg: ModelConfig, aux_scale: AuxLossScale, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = shared
        self.aux_scale = aux_scale

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        weights, idx, aux = self.router(x.reshape(-1, d), b)
        k = idx.shape[-1]
        out = self.experts(x, weights.view(b, t, k), idx.view(b, t, k))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if aux is not None:
            if not in_backward():
                self.aux_scale.value = self.aux_scale.value + aux.detach().double()  # on the device
                self.aux_scale.count += 1
            out = AttachAuxLoss.apply(out, aux, self.aux_scale)
        return out


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE modules, in layer order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


@torch.no_grad()
def update_balance_bias(layers: list[MoE], load: Tensor, rate: float) -> None:
    """DeepSeek-V3's bias update after an optimizer step: ``bias += rate * sign(mean - load)``
    per layer, with ``load [layers, experts]`` the step's tokens per expert over all ranks."""
    for moe, counts in zip(layers, load, strict=True):
        moe.router.expert_bias += rate * torch.sign(counts.mean() - counts).to(moe.router.expert_bias.dtype)
