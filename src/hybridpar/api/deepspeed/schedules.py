"""DeepSpeed's LR schedules (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``) as pure functions.

DeepSpeed's scheduler objects set the optimizer's LR at construction (iteration -1) and after
every optimizer step that was not skipped (``it`` = such steps taken - 1), so optimizer step
``k`` (from 1, none skipped) runs at iteration ``k - 2``: its first two steps both use the warm-up's
start. These functions give the LRs for an iteration, with DeepSpeed's formulas
(``deepspeed/runtime/lr_schedules.py``), so the engine needs no scheduler state beyond its step
counts (which checkpoints keep).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from hybridpar.config import ConfigError

__all__ = ["check_schedule", "schedule_lrs"]


def _per_group(value: Any, n: int) -> list[float]:
    return [float(v) for v in value] if isinstance(value, list | tuple) else [float(value)] * n


def _warmup(it: int, steps: int, kind: str) -> float:
    return math.log(it + 1) / math.log(steps) if kind == "log" else it / steps


def check_schedule(kind: str, params: Mapping[str, Any]) -> None:
    """Refuse values DeepSpeed's schedulers would misread (one line each)."""
    if params.get("warmup_type", "log") not in ("log", "linear"):
        raise ConfigError(f"ds_config: scheduler.params.warmup_type = {params['warmup_type']!r} must be 'log' or 'linear'")
    if kind != "WarmupLR" and "total_num_steps" not in params:
        raise ConfigError(f"ds_config: scheduler {kind} needs params.total_num_steps (optimizer steps of the run)")
    if kind == "WarmupCosineLR" and int(params.get("warmup_num_steps", 1000)) <= 0:
        raise ConfigError("ds_config: scheduler.params.warmup_num_steps must be a positive integer for WarmupCosineLR")


def schedule_lrs(kind: str, params: Mapping[str, Any], base_lrs: Sequence[float], it: int) -> list[float]:
    """The LR of each parameter group at scheduler iteration ``it`` (-1: before the first step)."""
    n = len(base_lrs)
    steps = max(2, int(params.get("warmup_num_steps", 1000)))
    kind_of_warmup = params.get("warmup_type", "log")
    if kind == "WarmupCosineLR":
        if it < 0:
            return [0.0] * n
        if it < steps:
            low = float(params.get("warmup_min_ratio", 0.0))
            ratio = low + _warmup(it, steps, kind_of_warmup) * (1.0 - low)
        else:
            total = max(1, int(params["total_num_steps"]) - steps)
            progress = min(1.0, (it - steps + 1) / total)
            floor = float(params.get("cos_min_ratio", 0.0001))
            ratio = max(0.0, floor + (1.0 - floor) * (1 + math.cos(math.pi * progress)) / 2)
        return [lr * ratio for lr in base_lrs]
    lows = _per_group(params.get("warmup_min_lr", 0.0), n)
    highs = _per_group(params.get("warmup_max_lr", 0.001), n)
    if it < 0:
        return lows
    if it < steps:
        gamma = _warmup(it, steps, kind_of_warmup)
    elif kind == "WarmupDecayLR":
        total = int(params["total_num_steps"])
        gamma = max(0.0, float(total - it) / float(max(1.0, total - steps)))
    else:
        gamma = 1.0
    return [lo + (hi - lo) * gamma for lo, hi in zip(lows, highs, strict=True)]
