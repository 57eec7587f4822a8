"""int8 gradient compression, the component (``parallel.grad_compression = "int8"``): its
error-feedback residuals are in the units of the scaled fp16 gradients, so when the loss scale
changes they are rescaled by the same factor, and after a step with non-finite gradients (the
update skipped) they are forgotten, having been computed from those gradients. The residuals
themselves are part of the data-parallel optimizer's checkpoint state."""

from __future__ import annotations

from typing import cast

from hybridpar.config import Config
from hybridpar.parallel.zero.base import ErrorFeedback
from hybridpar.training.features.base import UpdateOutcome
from hybridpar.training.features.component import Component, Launch, RunContext

__all__ = ["Int8Compression"]


class Int8Compression(Component):
    """The error feedback of the engine's data-parallel optimizer (module doc)."""

    name = "int8"
    backward_writes_checkpoint_state = True  # the backward updates the residuals a checkpoint holds

    @classmethod
    def enabled(cls, cfg: Config, launch: Launch) -> bool:
        return cfg.parallel.grad_compression == "int8"

    def attach(self, run: RunContext) -> None:
        self.engine = run.engine

    def after_update(self, step: int, outcome: UpdateOutcome) -> None:
        """fp16's loss scale moved: rescale the residuals, or forget them (non-finite gradients).
        The update itself reads no residual (they feed the next backward's reduction)."""
        if outcome.scale_factor == 1.0:
            return
        optimizer = cast(ErrorFeedback, self.engine.optimizer)  # int8 runs only on ZeRO's optimizers, which compress
        if outcome.finite:
            optimizer.scale_residuals(outcome.scale_factor)
        else:
            optimizer.reset_residuals()  # computed from non-finite gradients
