"""Asynchronous checkpoints in the step (``train.async_checkpoint``): a background thread copies
each save to host memory and writes it (:class:`~hybridpar.training.checkpoint.BackgroundWriter`);
the step waits for that copy before it changes what the save holds. That is before the update
(weights, optimizer state, loss scale), and before the backward too when another feature's
backward rewrites checkpointed state (int8's residuals, 2BW's second weight version:
:attr:`StepFeature.backward_writes_checkpoint_state`). The end of the run reports how long
training waited for the background saves."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybridpar.training.checkpoint import BackgroundWriter
from hybridpar.training.features.base import StepFeature
from hybridpar.training.metrics import MetricsLogger

__all__ = ["AsyncCheckpointStaging"]


class AsyncCheckpointStaging(StepFeature):
    """Holds the step for ``writer()`` (the Trainer's writer, looked up at each use, None: saves
    are synchronous); ``stalls()``: the run's (step, seconds waited) per checkpoint."""

    def __init__(self, writer: Callable[[], BackgroundWriter | None], stalls: Callable[[], list[tuple[int, float]]],
                 hold_before_backward: bool) -> None:
        self.writer, self.stalls, self.hold_before_backward = writer, stalls, hold_before_backward

    def start_step(self, step: int, batches: Sequence[tuple]) -> None:
        if self.hold_before_backward:
            self.maybe_wait_for_staging()

    def before_update(self, step: int) -> None:
        self.maybe_wait_for_staging()

    def maybe_wait_for_staging(self) -> None:
        """Wait until a save in flight has copied the state (no-op without one)."""
        writer = self.writer()
        if writer is not None:
            writer.hold()

    def end_run(self, log: MetricsLogger) -> None:
        stalls = self.stalls()
        if self.writer() is not None and len(stalls) > 1:  # the last save is waited for at the end
            waits = [s for _, s in stalls[:-1]]
            log.write(f"checkpoints written in the background: training waited {1e3 * sum(waits) / len(waits):.1f} ms "
                      f"per checkpoint ({len(waits)} before the last)")
