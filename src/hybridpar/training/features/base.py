"""The seams of the training step: what a feature that joins it may hook into.

:class:`StepFeature` names every point of :meth:`hybridpar.training.trainer.Trainer.train_step`
and :meth:`~hybridpar.training.trainer.Trainer.fit` where a feature acts, each a no-op by
default, so a feature overrides only the hooks it needs. :class:`StepHooks` holds the features
of a run (:func:`hybridpar.training.features.features_for` builds them from the config) and calls
each hook on every feature in registration order; the Trainer calls only it, so its loop names
no feature: data -> hooks -> engine -> hooks -> update -> hooks -> log / checkpoint.

The order within one step (``train_step``)::

    batches(step)                 # a feature may supply the step's micro-batches (read early)
    start_step(step, batches)     # before forward and backward
    after_backward(step, M)       # gradients reduced, nothing the update changes changed yet;
                                  # returns per-step statistics (collective)
    after_update(step, outcome)   # the update is done: stepped or skipped, the loss scale's move

and around the steps (``fit``): ``start_run(start, log)`` once before the first step,
``after_step(step, log)`` after each, ``end_run(log)`` after the last, ``summary()`` for
``summary.json``. Checkpoints carry :meth:`StepFeature.state_dict` beside the Trainer's own
state (``checkpoint.save(extra=...)``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from hybridpar.training.metrics import MetricsLogger

__all__ = ["DeviceStats", "StepFeature", "StepHooks", "Stats", "UpdateOutcome", "merge_stats"]

@dataclass(frozen=True)
class DeviceStats:
    """Statistics kept on the device: ``tensors`` are read to the host together with the step's
    loss and norm (one transfer, at the steps ``fit`` logs), then ``make`` builds the record's
    dict from their values (one flat list per tensor)."""

    tensors: tuple[Tensor, ...]
    make: Callable[[list[list[float]]], dict[str, Any]]


@dataclass(frozen=True)
class UpdateOutcome:
    """How a step's update went, for :meth:`StepFeature.after_update`: whether the optimizer
    ``stepped`` (False: the update was skipped), fp16's loss scale multiplied by ``scale_factor``
    this step (1.0: unchanged), and whether the gradients were ``finite`` (fp16's overflow check)."""

    stepped: bool = True
    scale_factor: float = 1.0
    finite: bool = True


#: a step's statistics for its record: the dict, or the device tensors that make it when read
Stats = dict[str, Any] | DeviceStats


def merge_stats(parts: Sequence[Stats]) -> Stats:
    """The features' statistics as one (later features' keys win): a dict when every part is
    one, else one :class:`DeviceStats` over all parts' tensors."""
    if all(isinstance(p, dict) for p in parts):
        return {k: v for p in parts if isinstance(p, dict) for k, v in p.items()}
    tensors = tuple(t for p in parts if isinstance(p, DeviceStats) for t in p.tensors)
    return DeviceStats(tensors, functools.partial(_make_merged, parts))


def _make_merged(parts: Sequence[Stats], values: list[list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        if isinstance(part, DeviceStats):
            n = len(part.tensors)
            out.update(part.make(values[:n]))
            values = values[n:]
        else:
            out.update(part)
    return out


class StepFeature:
    """One feature's part in the training step (module doc); every hook is a no-op here.

    Hooks that are collective (they communicate) are called on every rank alike, at the same
    point of every step, so a feature may communicate in them."""

    #: whether the step's backward rewrites state a checkpoint holds (a background save still
    #: copying it must be waited for before the backward, not only before the update)
    backward_writes_checkpoint_state: bool = False

    def start_run(self, start: int, log: MetricsLogger) -> None:
        """Before the first step of this run, which continues after step ``start`` (0: fresh)."""

    def batches(self, step: int) -> list[tuple] | None:
        """This rank's micro-batches of ``step`` if the feature has them already, else None."""
        return None

    def start_step(self, step: int, batches: Sequence[tuple]) -> None:
        """Step ``step`` is about to run forward and backward on ``batches``."""

    def after_backward(self, step: int, microbatches: int) -> Stats | None:
        """The step's gradients are complete, and nothing the update changes (loss scale,
        weights, optimizer state) has changed yet; returns statistics for its ``metrics.jsonl``
        record (None: none): a dict, or :class:`DeviceStats` (kept on the device, read only at
        the steps that log, with the loss). Collective."""
        return None

    def after_update(self, step: int, outcome: UpdateOutcome) -> None:
        """The step's update is done: ``outcome`` says whether the optimizer stepped (a skipped
        step gets here too) and how fp16's loss scale moved. Every rank alike: may be collective."""

    def after_step(self, step: int, log: MetricsLogger) -> None:
        """After ``train_step(step)`` in ``fit``, before the step is logged. Collective."""

    def end_run(self, log: MetricsLogger) -> None:
        """After the last step of ``fit`` (a background save, if any, has been waited for)."""

    def summary(self) -> dict[str, Any]:
        """Keys this feature adds to ``summary.json``."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """State a checkpoint keeps for this feature (tensors, under names no other uses)."""
        return {}

    def state_to_load(self, path: Path) -> dict[str, Any]:
        """The template of the state to read from checkpoint ``path`` (default: what
        :meth:`state_dict` saves); a feature drops what that checkpoint cannot hold."""
        return self.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After a checkpoint load: ``state`` holds every feature's loaded state by name."""


class StepHooks:
    """The run's features, each hook called on all of them in order (module doc)."""

    def __init__(self, features: Sequence[StepFeature]) -> None:
        self.features = list(features)

    def __iter__(self) -> Iterator[StepFeature]:
        return iter(self.features)

    def start_run(self, start: int, log: MetricsLogger) -> None:
        for f in self.features:
            f.start_run(start, log)

    def batches(self, step: int) -> list[tuple] | None:
        """The first feature's micro-batches of ``step`` (None: read them as usual)."""
        for f in self.features:
            found = f.batches(step)
            if found is not None:
                return found
        return None

    def start_step(self, step: int, batches: Sequence[tuple]) -> None:
        for f in self.features:
            f.start_step(step, batches)

    def after_backward(self, step: int, microbatches: int) -> Stats | None:
        """Every feature's statistics merged (:func:`merge_stats`; None when none has any)."""
        parts = [mine for f in self.features if (mine := f.after_backward(step, microbatches)) is not None]
        return merge_stats(parts) if parts else None

    def after_update(self, step: int, outcome: UpdateOutcome) -> None:
        for f in self.features:
            f.after_update(step, outcome)

    def after_step(self, step: int, log: MetricsLogger) -> None:
        for f in self.features:
            f.after_step(step, log)

    def end_run(self, log: MetricsLogger) -> None:
        for f in self.features:
            f.end_run(log)

    def summary(self) -> dict[str, Any]:
        return {k: v for f in self.features for k, v in f.summary().items()}

    def state_dict(self) -> dict[str, Any]:
        return {k: v for f in self.features for k, v in f.state_dict().items()}

    def state_to_load(self, path: Path) -> dict[str, Any]:
        return {k: v for f in self.features for k, v in f.state_to_load(path).items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in self.features:
            f.load_state_dict(state)
