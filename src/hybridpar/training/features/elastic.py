"""An elastic job, the component (``hybridpar train --elastic MIN:MAX``): the layout this (re)start
trains under is recorded in ``layouts.json`` (rank 0), a change of world size is logged, and
``summary.json`` lists the run's layouts as ``layout_changes``."""

from __future__ import annotations

from typing import Any

from hybridpar.config import Config
from hybridpar.training import elastic
from hybridpar.training.elastic import LayoutChange
from hybridpar.training.features.component import Component, Launch, RunContext
from hybridpar.training.metrics import MetricsLogger

__all__ = ["ElasticComponent"]


class ElasticComponent(Component):
    """Records the launch's layout change in the run directory (module doc)."""

    name = "elastic"

    @classmethod
    def enabled(cls, cfg: Config, launch: Launch) -> bool:
        return launch.elastic is not None

    def __init__(self, cfg: Config, launch: Launch) -> None:
        super().__init__(cfg, launch)
        assert launch.elastic is not None  # enabled() said so
        self.change: LayoutChange = launch.elastic

    def attach(self, run: RunContext) -> None:
        self.run_dir, self.is_logger = run.run_dir, run.is_logger

    def start_run(self, start: int, log: MetricsLogger) -> None:
        if not self.is_logger:
            return
        changes = elastic.record(self.run_dir, self.change, start)
        if len(changes) > 1 and changes[-1]["step"] == start:
            before, now = changes[-2], self.change
            log.write(f"elastic: world {before['world']} -> {now.world} at step {start}: layout "
                      f"{before['layout']} -> {now.layout} ({now.reason})")

    def summary(self) -> dict[str, Any]:
        return {"layout_changes": elastic.history(self.run_dir)}
