"""``parallel.offload_activations`` in the run: how much of this rank's saved activations sat in
host memory at most during a step (the offload's own count, :class:`HostBytes`), in the log after
the first step and as ``activation_offload_host_mb`` (the most of any rank, every step so far)
in ``summary.json``. The offload itself is an engine build step (``Engine._offload_activations``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridpar.distributed.mesh import Topology
from hybridpar.parallel.offload_activations import ActivationOffload
from hybridpar.training.features.base import StepFeature
from hybridpar.training.metrics import MetricsLogger

__all__ = ["ActivationOffloadReport"]


class ActivationOffloadReport(StepFeature):
    """Reports the host bytes of ``offload`` (module doc)."""

    def __init__(self, topo: Topology, device: torch.device, offload: ActivationOffload) -> None:
        self.topo, self.device, self.offload = topo, device, offload
        self.first_step = 1
        self.peak = 0  # this rank's most host bytes in any step so far

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
