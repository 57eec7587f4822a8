"""Mixed precision: autocast choice and fp16 dynamic loss scaling that agrees across ranks.

Parameters, gradients and optimizer state stay fp32 (the master copy); autocast runs matmuls in
bf16 or fp16. fp16's narrow range needs the loss multiplied by a scale before backward so small
gradients do not flush to zero; when any gradient on *any* rank overflows, every rank skips the
step and halves the scale, and after ``window`` clean steps the scale doubles.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from hybridpar.distributed.mesh import Axis

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The autocast context for ``train.precision`` (a no-op for fp32)."""
    if precision in _DTYPES:
        return torch.autocast(device_type=device.type, dtype=_DTYPES[precision])
    return contextlib.nullcontext()


def nonfinite_flag(values: Iterable[torch.Tensor], world: Axis) -> torch.Tensor:
    """``[1]`` float tensor on the values' device, 1 when any element of ``values`` on any rank
    of ``world`` is Inf or NaN, else 0: one scalar max-all-reduce, so every rank holds the same
    flag, and nothing is read to the host (the caller reads it, with whatever else it reads)."""
    flags = [torch.logical_not(torch.isfinite(v.detach())).any() for v in values]
    flag = torch.stack(flags).any().float().reshape(1) if flags else torch.zeros(1)
    world.comm.all_reduce(flag, world, op="max")
    return flag


class LossScaler:
    """Dynamic loss scale for fp16 (disabled: scale 1 and no checks).

    A step is :meth:`unscale` (on the device: the overflow flag, agreed over every rank, and the
    gradients multiplied back) and then, once the caller has read that flag to the host together
    with the step's other values (one device synchronization), :meth:`decide`."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, window: int = 200,
                 growth: float = 2.0, backoff: float = 0.5, min_scale: float = 1.0, hysteresis: int = 1) -> None:
        self.enabled = enabled
        self.hysteresis = hysteresis  # overflows in a row that the scale survives before it shrinks (DeepSpeed's)
        self.tolerance = hysteresis  # what is left of it
        self.scale = init_scale if enabled else 1.0
        self.window = window
        self.growth = growth
        self.backoff = backoff
        self.min_scale = min_scale
        self.clean_steps = 0
        self.skipped = 0

    def unscale(self, grads: list[torch.Tensor], world: Axis, replicas: int = 1) -> torch.Tensor | None:
        """After backward and the data-parallel reduction, on the gradients this rank holds
        (whole, or its ZeRO shard of them): the overflow flag of :func:`nonfinite_flag` (every
        rank of ``world`` the same; None when disabled), and the gradients multiplied by
        ``replicas / scale`` (``replicas``: the gradients were scaled by ``scale / replicas``,
        i.e. each of ``replicas`` data-parallel ranks scaled as one process scales the whole
        batch, then they were averaged). Nothing is read to the host."""
        if not self.enabled:
            return None
        flag = nonfinite_flag(grads, world)
        inv = replicas / self.scale
        for g in grads:
            g.mul_(inv)
        return flag

    def decide(self, overflow: bool, grads: list[torch.Tensor]) -> bool:
        """With the flag :meth:`unscale` returned, read: on overflow zero ``grads``, shrink the
        scale (with ``hysteresis`` > 1: once that many overflows came without a growth between
        them, as DeepSpeed's) and return False (skip the step); otherwise count a clean step (the
        scale grows after ``window`` of them, which restores the hysteresis) and return True."""
        if overflow:
            for g in grads:
                g.zero_()
            if self.tolerance > 1:
                self.tolerance -= 1
            else:
                self.scale = max(self.min_scale, self.scale * self.backoff)
            self.clean_steps = 0
            self.skipped += 1
            return False
        self.clean_steps += 1
        if self.clean_steps % self.window == 0:
            self.scale *= self.growth
            self.tolerance = self.hysteresis
        return True

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped = int(state["skipped"])


def record_nonfinite(record: torch.Tensor | None, step: int, loss: torch.Tensor) -> torch.Tensor:
    """``[step, loss]`` (float64, on ``loss``'s device) of the first step whose ``loss`` is NaN or
    Inf: ``record`` (None: none so far) kept, or this step's if it is the first. Decided on the
    device (``torch.where``), so noting it never waits for the device; step 0: none yet."""
    if record is None:
        record = torch.zeros(2, dtype=torch.float64, device=loss.device)
    here = torch.stack([torch.full((), step, dtype=torch.float64, device=loss.device),
                        loss.detach().reshape(()).to(torch.float64)])
    first = torch.logical_not(torch.isfinite(loss.detach().reshape(()))) & (record[0] == 0)
    return torch.where(first, here, record)
