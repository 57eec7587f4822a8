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
    after_backward(step, M)       # gradients reduced; returns per-step statistics (collective)
    before_update(step)           # before anything the update changes (loss scale, weights)
    loss_scale_changed(f, clean)  # fp16: the loss scale moved by factor f this step
    after_update(step)            # the optimizer stepped (not on a skipped step)

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

__all__ = ["DeviceStats", "StepFeature", "StepHooks", "Stats", "merge_stats"]

@dataclass(frozen=True)
class DeviceStats:
    """Statistics kept on the device: ``tensors`` are read to the host together with the step's
    loss and norm (one transfer, at the steps ``fit`` logs), then ``make`` builds the record's
    dict from their values (one flat list per tensor)."""

    tensors: tuple[Tensor, ...]
    make: Callable[[list[list[float]]], dict[str, Any]]


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
        """The step's gradients are complete; returns statistics for its ``metrics.jsonl``
        record (None: none): a dict, or :class:`DeviceStats` (kept on the device, read only at
        the steps that log, with the loss). Collective."""
        return None

    def before_update(self, step: int) -> None:
        """Before the loss-scale check and the optimizer update change any state."""

    def loss_scale_changed(self, factor: float, clean: bool) -> None:
        """fp16: the loss scale was multiplied by ``factor`` this step; ``clean``: the
        gradients were finite (False: the update is skipped)."""

    def after_update(self, step: int) -> None:
        """The optimizer stepped (skipped steps do not get here). May be collective."""

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

    def before_update(self, step: int) -> None:
        for f in self.features:
            f.before_update(step)

    def loss_scale_changed(self, factor: float, clean: bool) -> None:
        for f in self.features:
            f.loss_scale_changed(factor, clean)

    def after_update(self, step: int) -> None:
        for f in self.features:
            f.after_update(step)

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
