"""The data-parallel optimizer interface the training step types against.

Every optimizer the step engine (:class:`hybridpar.training.step.StepEngine`) drives implements
:class:`DataParallelOptimizer`, three parts by concern: :class:`GradientSync` (the data-parallel
gradient reduction of the parameters it updates, the per-rank share of the global gradient
norm, clipping), :class:`Update` (the parameter groups and the step) and
:class:`CheckpointState`. int8 compression's error feedback (:class:`ErrorFeedback`) is a fourth,
only on the optimizers that compress. The implementations:

- :class:`~hybridpar.parallel.zero.optimizer.ZeroOptimizer`: ZeRO stage 0 (replicated: bucketed
  all-reduce), 1/2 (sharded optimizer state, + gradients) and 3 (sharded parameters);
- :class:`~hybridpar.parallel.zero.expert_split.ExpertSplitOptimizer`: two of them as one, dense
  parameters over dp x cp and experts over edp (expert parallelism);
- :class:`LocalOptimizer`: a plain ``torch.optim`` optimizer (or none) for a model without data
  parallelism: :class:`WholeGradients` (nothing to reduce, the norm and clipping over the
  parameters it was given), its own update and state, no error feedback.

So the step asks no ``isinstance``: whatever differs between them (whether gradients are
reduced per pipeline stage, which axes a norm part sums over, what a checkpoint holds) is a
method or property here.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from hybridpar.compat import foreach_mul_
from hybridpar.distributed.mesh import Axis

if TYPE_CHECKING:
    from hybridpar.parallel.zero.reducer import GradientReducer
    from hybridpar.parallel.zero.zero3 import ShardedModel

__all__ = ["CheckpointState", "DataParallelOptimizer", "ErrorFeedback", "GradientSync", "LocalOptimizer", "NamedGrads",
           "NormPart", "Update", "WholeGradients", "clip_grads"]

NamedGrads = list[tuple[str, torch.Tensor]]
#: (named gradients this rank holds, the axes their squared norm is summed over besides tp and pp)
NormPart = tuple[NamedGrads, list[Axis]]


class GradientSync(Protocol):
    """The gradient part: each micro-batch's backward accumulates, the step's reduction over
    the data-parallel axes is started and waited for, and the reduced gradients are read for
    the norm and clipped.

    The step protocol: :meth:`zero_grad`; backward of each micro-batch, all but the last inside
    :meth:`no_sync`; :meth:`finish_grads`; the norm from :meth:`norm_parts`; :meth:`clip`."""

    @property
    def reducer(self) -> GradientReducer | None:
        """ZeRO stage 0's bucketed all-reduce (None for any other optimizer)."""
        ...

    @property
    def sharded(self) -> ShardedModel | None:
        """The ZeRO-3 sharded model this optimizer steps (None when parameters are whole)."""
        ...

    @property
    def reduces_per_stage(self) -> bool:
        """Whether the pipeline runner's stage hooks reduce the gradients (ZeRO-3 under pp), so
        a pipelined step must not run inside :meth:`no_sync`."""
        ...

    def no_sync(self) -> AbstractContextManager[Any]:
        """Accumulate gradients locally inside the block (every micro-batch but the last)."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a step's gradients from zero."""
        ...

    def finish_grads(self) -> None:
        """Wait for (and start any missing) gradient reduction of this step; idempotent."""
        ...

    def named_grads(self) -> NamedGrads:
        """``(name, reduced gradient this rank holds)`` per parameter with one."""
        ...

    def grad_tensors(self) -> list[torch.Tensor]:
        """The reduced gradient tensors this rank holds (in-place scaling reaches the update)."""
        ...

    def norm_parts(self) -> list[NormPart]:
        """This rank's gradients, in parts that each sum their squares over their own axes."""
        ...

    def clip(self, total_norm: torch.Tensor, max_norm: float) -> None:
        """Scale the gradients so their global norm is at most ``max_norm`` (0 disables)."""
        ...


class Update(Protocol):
    """The update part: the parameter groups the LR schedule sets, and the step."""

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups (the LR schedule sets ``group["lr"]``)."""
        ...

    def step(self) -> None:
        """Update the parameters from the reduced gradients."""
        ...


class CheckpointState(Protocol):
    """The checkpoint part: the optimizer's state, and the model's placed as this optimizer
    holds it (whole, or ZeRO-3's shards) for ``dcp.save`` and ``dcp.load``."""

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state, keyed by parameter name."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        ...

    def checkpoint_state(self, model: nn.Module, same_layout: bool = True) -> dict[str, Any]:
        """``{"model": ..., "optim": ..., ...}`` for ``dcp.save`` / as the template of ``dcp.load``.
        ``same_layout``: the checkpoint to be loaded into it was written under this very layout,
        so per-rank state (int8 error feedback) is part of it; otherwise it is left out."""
        ...

    def load_checkpoint_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Apply a (``dcp.load``-filled) :meth:`checkpoint_state`."""
        ...

    def gather_full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every parameter and buffer whole over the data-parallel shards (still tp pieces), on
        every rank (collective); None when this optimizer shards no parameter (read the model)."""
        ...


@runtime_checkable
class DataParallelOptimizer(GradientSync, Update, CheckpointState, Protocol):
    """What the step engine, the trainer and checkpoints ask of an optimizer (module doc): its
    three parts, :class:`GradientSync`, :class:`Update` and :class:`CheckpointState`. The step
    protocol: :class:`GradientSync`'s, then :meth:`step`."""


class ErrorFeedback(Protocol):
    """int8 gradient compression's error feedback, on the optimizers that compress (ZeRO's and
    the expert split; not part of :class:`DataParallelOptimizer`: a plain optimizer has none).
    The int8 component (``training/features/int8.py``) is its one caller."""

    def residuals(self) -> dict[str, torch.Tensor]:
        """The error-feedback state (empty without compression)."""
        ...

    def reset_residuals(self) -> None:
        """Forget the error feedback (a skipped step's gradients were not finite)."""
        ...

    def scale_residuals(self, factor: float) -> None:
        """Rescale the error feedback (the fp16 loss scale changed by ``factor``)."""
        ...


@torch.no_grad()
def clip_grads(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place by ``min(1, max_norm / total_norm)`` (``max_norm`` 0: unchanged),
    on the device: the coefficient is never read to the host, and one multi-tensor multiply per
    device and dtype applies it (bit-equal to a ``mul_`` per tensor)."""
    if max_norm <= 0:
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    foreach_mul_(grads, coef)


class WholeGradients:
    """:class:`GradientSync` for ``named`` parameters that no data-parallel axis replicates:
    gradients are complete after backward (nothing to start, wait for or reduce), the norm is
    over these parameters alone. A plain optimizer needs only this part, with its own
    ``zero_grad``, update and state (:class:`LocalOptimizer`)."""

    reducer = None
    sharded = None
    reduces_per_stage = False

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        self.named = list(named)

    def no_sync(self) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def finish_grads(self) -> None:
        """Nothing to wait for: no data-parallel reduction."""

    def named_grads(self) -> NamedGrads:
        return [(n, p.grad) for n, p in self.named if p.grad is not None]

    def grad_tensors(self) -> list[torch.Tensor]:
        return [g for _, g in self.named_grads()]

    def norm_parts(self) -> list[NormPart]:
        return [(self.named_grads(), [])]

    def clip(self, total_norm: torch.Tensor, max_norm: float) -> None:
        clip_grads(self.grad_tensors(), total_norm, max_norm)


class LocalOptimizer(WholeGradients):
    """A plain ``torch.optim`` optimizer (``inner``; None: forward and backward only) over
    ``named`` parameters that no data-parallel axis replicates: :class:`WholeGradients`, the
    inner optimizer's update, and checkpoints of the model's and the optimizer's own state dicts."""

    def __init__(self, inner: torch.optim.Optimizer | None, named: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__(named)
        self.inner = inner

    def _optimizer(self) -> torch.optim.Optimizer:
        if self.inner is None:
            raise RuntimeError("StepEngine.update needs an optimizer")
        return self.inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer().param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer().zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self._optimizer().step()

    def state_dict(self) -> dict[str, Any]:
        return self._optimizer().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer().load_state_dict(state_dict)

    def checkpoint_state(self, model: nn.Module, same_layout: bool = True) -> dict[str, Any]:  # noqa: ARG002
        return {"model": model.state_dict(), "optim": self.state_dict()}

    def load_checkpoint_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        self.load_state_dict(state["optim"])

    def gather_full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return None
