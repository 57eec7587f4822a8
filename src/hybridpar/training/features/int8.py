"""int8 gradient compression in the step (``parallel.grad_compression = "int8"``): its
error-feedback residuals are in the units of the scaled fp16 gradients, so when the loss scale
changes they are rescaled by the same factor, and after a step with non-finite gradients (the
update skipped) they are forgotten, having been computed from those gradients. The residuals
themselves are part of the data-parallel optimizer's checkpoint state."""

from __future__ import annotations

from hybridpar.training.features.base import StepFeature
from hybridpar.training.step import StepEngine

__all__ = ["Int8Residuals"]


class Int8Residuals(StepFeature):
    """The error feedback of ``engine``'s data-parallel optimizer (module doc)."""

    backward_writes_checkpoint_state = True  # the backward updates the residuals a checkpoint holds

    def __init__(self, engine: StepEngine) -> None:
        self.engine = engine

    def loss_scale_changed(self, factor: float, clean: bool) -> None:
        optimizer = self.engine.optimizer  # a DataParallelOptimizer: without compression these are no-ops
        if clean:
            optimizer.scale_residuals(factor)
        else:
            optimizer.reset_residuals()  # computed from non-finite gradients
