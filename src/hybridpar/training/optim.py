"""Optimizer, learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from hybridpar.config import TrainConfig
from hybridpar.parallel.tensor_plan import sum_of_squares


def build_optimizer(model: nn.Module | Iterable[nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW over a model's (or the given) parameters, with weight decay on matrices only (norm
    gains and other vectors are not decayed)."""
    params = list(model.parameters() if isinstance(model, nn.Module) else model)
    decay = [p for p in params if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in params if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def warmup_cosine(step: int, peak: float, floor: float, warmup_steps: int, decay_steps: int) -> float:
    """The one LR schedule of every front door: linear warm-up to ``peak`` over ``warmup_steps``,
    then cosine decay to ``floor`` over ``decay_steps`` (``<= 0``: constant ``peak``) and
    ``floor`` after. ``step`` counts from 1 (the first optimizer step uses ``peak / warmup_steps``)."""
    if warmup_steps > 0 and step <= warmup_steps:
        return peak * step / warmup_steps
    if decay_steps <= 0:
        return peak
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The trainer's LR: warm-up over ``warmup_steps``, cosine to ``min_lr`` at ``steps``."""
    return warmup_cosine(step, cfg.lr, cfg.min_lr, cfg.warmup_steps, max(1, cfg.steps - cfg.warmup_steps))


def grad_norm_sq(params: Iterable[nn.Parameter]) -> torch.Tensor:
    """Sum of squared gradient entries of the given parameters, in fp64 (the trainer's norm,
    :func:`~hybridpar.parallel.tensor_plan.sum_of_squares`, on the first gradient's device)."""
    grads = [p.grad for p in params if p.grad is not None]
    return sum_of_squares(grads, grads[0].device if grads else torch.device("cpu"))


def clip_by_total_norm(params: list[nn.Parameter], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale gradients in place so their global norm is at most ``max_norm`` (0 disables)."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
