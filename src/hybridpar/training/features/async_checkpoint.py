"""Asynchronous checkpoints (``async_checkpoint.enabled``), the component: it builds the background
writer (:class:`~hybridpar.training.checkpoint.BackgroundWriter`: a thread copies each save to
host memory and writes it), and the step waits for that copy before it changes what the save
holds. That is before the update (weights, optimizer state, loss scale), and before the backward
too when a component of the run rewrites checkpointed state in its backward (int8's residuals,
2BW's second weight version: :attr:`StepFeature.backward_writes_checkpoint_state`, asked of every
component of the run, whatever its place in the order). The end of the run reports how long
training waited for the background saves."""

from __future__ import annotations

from collections.abc import Sequence

from hybridpar.config import Config
from hybridpar.training.checkpoint import BackgroundWriter
from hybridpar.training.features.base import Stats
from hybridpar.training.features.component import Component, Launch, RunContext
from hybridpar.training.metrics import MetricsLogger

__all__ = ["AsyncCheckpoint"]


class AsyncCheckpoint(Component):
    """Owns the run's background ``writer`` and holds the step for it (module doc)."""

    name = "async_checkpoint"
    after = ("int8", "2bw")  # their backward rewrites what a save in flight is still copying

    @classmethod
    def enabled(cls, cfg: Config, launch: Launch) -> bool:
        return cfg.async_checkpoint.enabled

    def __init__(self, cfg: Config, launch: Launch) -> None:
        super().__init__(cfg, launch)
        self.writer: BackgroundWriter | None = None
        self.hold_before_backward = False
        self.stalls: list[tuple[int, float]] = []  # the run's (step, seconds training waited to save it)

    def attach(self, run: RunContext) -> None:
        self.writer = BackgroundWriter(run.topo, run.timeout_s)
        self.hold_before_backward = run.backward_writes_checkpoint_state
        self.stalls = run.checkpoint_stalls

    def start_step(self, step: int, batches: Sequence[tuple]) -> None:
        if self.hold_before_backward:
            self.maybe_wait_for_staging()

    def after_backward(self, step: int, microbatches: int) -> Stats | None:
        """Before the update changes what the save holds: wait for its copy."""
        self.maybe_wait_for_staging()
        return None

    def maybe_wait_for_staging(self) -> None:
        """Wait until a save in flight has copied the state (no-op without one)."""
        if self.writer is not None:
            self.writer.hold()

    def end_run(self, log: MetricsLogger) -> None:
        if self.writer is not None and len(self.stalls) > 1:  # the last save is waited for at the end
            waits = [s for _, s in self.stalls[:-1]]
            log.write(f"checkpoints written in the background: training waited {1e3 * sum(waits) / len(waits):.1f} ms "
                      f"per checkpoint ({len(waits)} before the last)")
