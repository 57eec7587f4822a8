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


def any_nonfinite(values: Iterable[torch.Tensor], world: Axis) -> bool:
    """True when any element of ``values`` on any rank of ``world`` is Inf or NaN.

    One scalar max-all-reduce, so every rank takes the same decision."""
    flags = [torch.logical_not(torch.isfinite(v.detach())).any() for v in values]
    flag = torch.stack(flags).any().float().reshape(1) if flags else torch.zeros(1)
    world.comm.all_reduce(flag, world, op="max")
    return bool(flag.item() > 0)


class LossScaler:
    """Dynamic loss scale for fp16 (disabled: scale 1 and no checks)."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, window: int = 200,
                 growth: float = 2.0, backoff: float = 0.5, min_scale: float = 1.0) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.window = window
        self.growth = growth
        self.backoff = backoff
        self.min_scale = min_scale
        self.clean_steps = 0
        self.skipped = 0

    def unscale_or_skip(self, grads: list[torch.Tensor], world: Axis, replicas: int = 1) -> bool:
        """After backward and the data-parallel reduction, on the gradients this rank holds
        (whole, or its ZeRO shard of them): on overflow on any rank, zero them, shrink the scale
        and return False (skip the step); otherwise multiply them by ``replicas / scale`` and
        return True (``replicas``: the gradients were scaled by ``scale / replicas``, i.e. each
        of ``replicas`` data-parallel ranks scaled as one process scales the whole batch, then
        they were averaged). Every rank of ``world`` takes the same decision (one max-all-reduce)."""
        if not self.enabled:
            return True
        if any_nonfinite(grads, world):
            for g in grads:
                g.zero_()
            self.scale = max(self.min_scale, self.scale * self.backoff)
            self.clean_steps = 0
            self.skipped += 1
            return False
        inv = replicas / self.scale
        for g in grads:
            g.mul_(inv)
        self.clean_steps += 1
        if self.clean_steps % self.window == 0:
            self.scale *= self.growth
        return True

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped = int(state["skipped"])
