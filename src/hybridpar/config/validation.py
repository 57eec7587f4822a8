"""Validation: every layout and shape rule (:mod:`hybridpar.rules`) applied before any process
group exists, so a bad config is one clear error instead of a hang; and the warnings for settings
that are allowed but do nothing or will be slow."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridpar.config.errors import ConfigError
from hybridpar.rules import first_broken

if TYPE_CHECKING:
    from hybridpar.config.run import Config

__all__ = ["config_warnings", "validate"]


def config_warnings(cfg: Config) -> list[str]:
    """Settings that are allowed but do nothing or will be slow; the CLI prints them."""
    p = cfg.parallel
    out = []
    if p.sequence_parallel and p.tp == 1:
        out.append("parallel.sequence_parallel = true has no effect with parallel.tp = 1; ignored")
    if p.cp_mode != "ring" and p.cp == 1:
        out.append(f"parallel.cp_mode = {p.cp_mode!r} has no effect with parallel.cp = 1; ignored")
    micro = cfg.microbatches
    if p.pp > 1 and micro < p.pp:
        idle = (p.pp - 1) / (micro + p.pp - 1)
        out.append(f"{micro} micro-batches per step < parallel.pp = {p.pp}: the pipeline is bubble-dominated "
                   f"(about {100 * idle:.0f}% idle); use at least {p.pp}, ideally {4 * p.pp} or more")
    return out


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Every layout and shape rule (:data:`hybridpar.rules.RULES`, in order). Raises one
    ConfigError naming numbers and fix: the first broken rule's message."""
    broken = first_broken(cfg, world_size)
    if broken is not None:
        raise ConfigError(broken[1])
