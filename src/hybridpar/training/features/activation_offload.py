"""Activation offload (``parallel.offload_activations``), the component: the build step that
sends what the first ``offload_activations_fraction`` of each pipeline chunk's blocks save for
backward to host memory (:class:`~hybridpar.parallel.offload_activations.ActivationOffload`),
and the report of how much of this rank's saved activations sat there at most during a step
(the offload's own count, :class:`HostBytes`): in the log after the first step and as
``activation_offload_host_mb`` (the most of any rank, every step so far) in ``summary.json``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hybridpar.config import Config
from hybridpar.parallel.offload_activations import ActivationOffload, offloaded_count
from hybridpar.training.features.component import Component, Launch, RunContext
from hybridpar.training.metrics import MetricsLogger

__all__ = ["ActivationOffloadComponent"]


class ActivationOffloadComponent(Component):
    """Offloads the chosen blocks' saved activations and reports their host bytes (module doc)."""

    name = "activation_offload"

    @classmethod
    def enabled(cls, cfg: Config, launch: Launch) -> bool:
        return cfg.parallel.offload_activations

    def __init__(self, cfg: Config, launch: Launch) -> None:
        super().__init__(cfg, launch)
        self.offload: ActivationOffload | None = None
        self.first_step = 1
        self.peak = 0  # this rank's most host bytes in any step so far

    def wrap_chunks(self, runs: list[list[nn.Module]], device: torch.device) -> None:
        """After recompute, so what a checkpoint keeps is what goes to host memory."""
        fraction = self.cfg.parallel.offload_activations_fraction
        chosen = [b for run in runs for b in run[:offloaded_count(len(run), fraction)]]
        self.offload = ActivationOffload(device)
        self.offload.apply(chosen)

    @property
    def blocks(self) -> int:
        """How many blocks of this rank offload."""
        return self.offload.blocks if self.offload is not None else 0

    def attach(self, run: RunContext) -> None:
        self.topo, self.device = run.topo, run.device

    def start_run(self, start: int, log: MetricsLogger) -> None:
        self.first_step = start + 1

    def start_step(self, step: int, batches: Sequence[tuple]) -> None:
        self.offload.host.reset_peak()

    def after_backward(self, step: int, microbatches: int) -> None:
        self.peak = max(self.peak, self.offload.host.peak)  # the step's forwards and backwards are done
        return None

    def after_step(self, step: int, log: MetricsLogger) -> None:
        if step == self.first_step:
            log.write(f"activation offload: {self.offload.blocks} blocks on this rank, "
                      f"{self.offload.host.peak / 2**20:.1f} MB of their saved activations in host memory at most")

    def summary(self) -> dict[str, Any]:
        """The most of any rank (collective: ``summary`` is called on every rank alike)."""
        most = torch.tensor([float(self.peak)], dtype=torch.float64, device=self.device)
        (value,) = self.topo.comm.all_reduce(most, self.topo.world, op="max").tolist()
        return {"activation_offload_host_mb": round(value / 2**20, 3)}
