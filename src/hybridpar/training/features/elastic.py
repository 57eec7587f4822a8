"""An elastic job in the run (``hybridpar train --elastic MIN:MAX``): the layout this (re)start
trains under is recorded in ``layouts.json`` (rank 0), a change of world size is logged, and
``summary.json`` lists the run's layouts as ``layout_changes``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridpar.training import elastic
from hybridpar.training.elastic import LayoutChange
from hybridpar.training.features.base import StepFeature
from hybridpar.training.metrics import MetricsLogger

__all__ = ["ElasticLayouts"]


class ElasticLayouts(StepFeature):
    """Records ``change`` in ``run_dir`` (``is_logger``: this rank writes) (module doc)."""

    def __init__(self, change: LayoutChange, run_dir: Path, is_logger: bool) -> None:
        self.change, self.run_dir, self.is_logger = change, run_dir, is_logger

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
