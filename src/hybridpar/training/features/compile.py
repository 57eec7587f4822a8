"""``train.compile`` in the run: after the first step, what it compiled and how long that took
(the most of any rank: ranks compile different pieces, pipeline stages, graph breaks), in the
log and as ``compile_s`` in ``summary.json``."""

from __future__ import annotations

from typing import Any

import torch

from hybridpar.compat import compile_stats
from hybridpar.distributed.mesh import Topology
from hybridpar.training.features.base import StepFeature
from hybridpar.training.metrics import MetricsLogger

__all__ = ["CompileReport"]


class CompileReport(StepFeature):
    """Reports the ``blocks`` compiled blocks (``backend``) of this rank (module doc)."""

    def __init__(self, topo: Topology, device: torch.device, blocks: int, backend: str) -> None:
        self.topo, self.device, self.blocks, self.backend = topo, device, blocks, backend
        self.first_step = 1
        self.compile_s: float | None = None  # seconds the first step spent compiling

    def start_run(self, start: int, log: MetricsLogger) -> None:
        self.first_step = start + 1

    def after_step(self, step: int, log: MetricsLogger) -> None:
        if step == self.first_step:  # step 1 is logged, so its window ends there
            log.write(self.report())

    def report(self) -> str:
        """The first step's compilation, the slowest rank's. Collective."""
        stats = compile_stats()
        worst = torch.tensor([stats.seconds, stats.graphs, stats.graph_breaks], dtype=torch.float64,
                             device=self.device)
        seconds, graphs, breaks = self.topo.comm.all_reduce(worst, self.topo.world, op="max").tolist()
        self.compile_s = seconds
        return (f"compiled {self.blocks} blocks ({self.backend}): {seconds:.1f} s "
                f"compiling in the first step (the slowest rank), {int(graphs)} graphs, {int(breaks)} graph breaks")

    def summary(self) -> dict[str, Any]:
        return {} if self.compile_s is None else {"compile_s": round(self.compile_s, 2)}
