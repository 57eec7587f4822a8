"""Regional compilation (``train.compile``), the component: its build step compiles each block's
math (:func:`~hybridpar.parallel.compile.compile_blocks`; after FP8, which changes the blocks'
linears, and before recomputation, which reruns the compiled forward); after the first step,
what it compiled and how long that took (the most of any rank: ranks compile different pieces,
pipeline stages, graph breaks), in the log and as ``compile_s`` in ``summary.json``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridpar.compat import compile_stats
from hybridpar.config import Config
from hybridpar.distributed.mesh import Topology
from hybridpar.parallel.compile import compile_blocks
from hybridpar.training.features.component import Component, Launch, RunContext
from hybridpar.training.metrics import MetricsLogger

__all__ = ["CompileComponent"]


class CompileComponent(Component):
    """Compiles this rank's blocks (``train.compile_backend``) and reports them (module doc)."""

    name = "compile"
    after = ("fp8",)  # compiles the blocks as FP8 left them

    @classmethod
    def enabled(cls, cfg: Config, launch: Launch) -> bool:
        return cfg.train.compile

    def __init__(self, cfg: Config, launch: Launch) -> None:
        super().__init__(cfg, launch)
        self.backend = cfg.train.compile_backend
        self.blocks = 0  # how many blocks were compiled
        self.first_step = 1
        self.compile_s: float | None = None  # seconds the first step spent compiling

    def convert_blocks(self, blocks: list[nn.Module], topo: Topology, device: torch.device) -> None:
        self.blocks = compile_blocks(blocks, self.backend)

    def attach(self, run: RunContext) -> None:
        self.topo, self.device = run.topo, run.device

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
