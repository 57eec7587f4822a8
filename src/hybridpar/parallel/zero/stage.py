"""What a ZeRO stage family is (:class:`ZeroStage`) and the pieces every family shares.

:class:`~hybridpar.parallel.zero.optimizer.ZeroOptimizer` delegates the per-stage concerns of the
step protocol to one strategy object per stage family (:mod:`hybridpar.parallel.zero.stages`).
This module declares the questions every family answers (:class:`ZeroStage`), what the inner
optimizer steps for each parameter (a :class:`Slot`), a sharded group of parameters as the
optimizer sees it (:class:`ShardGroup`: a stage-1/2 bucket or a ZeRO-3 unit), and the model part
of a checkpoint for the stages that keep parameters whole over dp.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.zero.offload import DiskArena
from hybridpar.parallel.zero.reducer import GradientReducer
from hybridpar.parallel.zero.shard import GradShard, ShardLayout, ShardMesh
from hybridpar.parallel.zero.zero3 import ShardedModel

NamedParam = tuple[str, nn.Parameter]
LOW_PRECISION = (torch.bfloat16, torch.float16)


class Slot:
    """One parameter as the inner optimizer sees it.

    ``opt`` is the tensor it updates (its state is keyed by it); ``shape`` the parameter's shape
    over dp, of which checkpointed state is a piece; ``rows`` this rank's rows of it when the
    state is split over dp (None: whole); ``source`` the model tensor that ``opt`` is an fp32
    (or host) copy of, None when ``opt`` is the model's own tensor.
    """

    __slots__ = ("opt", "shape", "rows", "source")

    def __init__(self, opt: nn.Parameter, shape: torch.Size, rows: tuple[int, int] | None,
                 source: torch.Tensor | None) -> None:
        self.opt, self.shape, self.rows, self.source = opt, shape, rows, source

    @property
    def saves_master(self) -> bool:
        """Whether the copy carries bits the model tensor lacks (fp32 master of bf16/fp16), so a
        checkpoint stores it as ``"master"``; an fp32 offload copy is re-derived on load."""
        return self.source is not None and self.source.dtype in LOW_PRECISION


class ShardGroup:
    """A bucket (stages 1/2) or a ZeRO-3 unit, seen by the optimizer: this rank's rows of each
    parameter (``values``), their reduced gradients (``grads``), and optional fp32 masters."""

    def __init__(self, layout: ShardLayout, values: list[torch.Tensor], grads: GradShard,
                 full: list[nn.Parameter] | None, master: bool, offload: bool) -> None:
        self.layout, self.values, self.grads, self.full = layout, values, grads, full
        self.arena: DiskArena | None = None  # offload_to = "disk": the file holding the host state
        self.opt: list[nn.Parameter] = []
        self.master_flat: torch.Tensor | None = None
        self.host_grad: torch.Tensor | None = None
        if master:
            device = torch.device("cpu") if offload else values[0].device
            pin = offload and values[0].device.type == "cuda"
            self.master_flat = torch.zeros(layout.size, dtype=torch.float32, device=device, pin_memory=pin)
            masters = layout.views(self.master_flat)
            for m, v in zip(masters, values, strict=True):
                m.copy_(v.detach())
            self.opt = [nn.Parameter(m, requires_grad=False) for m in masters]
            if offload:
                self.host_grad = torch.zeros(layout.size, dtype=torch.float32, device=device, pin_memory=pin)
        else:
            self.opt = [v if isinstance(v, nn.Parameter) else nn.Parameter(v, requires_grad=False) for v in values]

    def slot(self, i: int) -> Slot:
        """Parameter ``i``'s slot: this rank's rows, or their fp32 master copy."""
        source = self.values[i] if self.master_flat is not None else None
        return Slot(self.opt[i], self.layout.shapes[i], self.layout.local_rows(i), source)


class ZeroStage(abc.ABC):
    """One stage family's side of the step protocol (see the module doc).

    ``slots`` maps ``id(parameter given)`` to its :class:`Slot`; ``groups`` are the sharded
    groups (empty for :class:`Replicated`); ``hooks`` the gradient hooks this strategy put on
    parameters; ``sync`` is False inside :meth:`no_sync`.
    """

    reducer: GradientReducer | None = None
    sharded: ShardedModel | None = None

    def __init__(self, named: list[NamedParam], axis: Axis) -> None:
        self.named, self.axis = named, axis
        self.sync = True
        self.slots: dict[int, Slot] = {}
        self.groups: list[ShardGroup] = []
        self.hooks: list[RemovableHandle] = []

    def residuals(self) -> list[torch.Tensor]:
        """int8 gradient compression's error-feedback state, in a fixed order (none without it)."""
        return [t for g in self.groups for t in g.grads.residuals()]

    @property
    @abc.abstractmethod
    def state_axis(self) -> Axis | None:
        """The axis the optimizer state is split over (None: every dp rank holds all of it)."""

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally inside this block; nothing is sent."""
        previous, self.sync = self.sync, False
        try:
            with self._quiet():
                yield
        finally:
            self.sync = previous

    def _quiet(self) -> AbstractContextManager[None]:
        """The no-sync block of whatever else reduces gradients for this strategy."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Start a step's gradients from zero."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Wait for (and start any missing) gradient reduction of this step; idempotent."""

    @abc.abstractmethod
    def grad_views(self) -> list[torch.Tensor]:
        """The reduced gradient tensors this rank holds (clipping scales them in place)."""

    @abc.abstractmethod
    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, gradient this rank holds)`` per parameter that has one."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where a zero gradient norm lives when no gradient exists."""

    @abc.abstractmethod
    def sum_over_dp(self, total: torch.Tensor) -> None:
        """Turn this rank's sum of squared gradients into the global one, in place."""

    @abc.abstractmethod
    def load_grads(self) -> None:
        """Hand the reduced gradients to the tensors the inner optimizer steps."""

    @abc.abstractmethod
    def store_updates(self) -> None:
        """After the inner step: bring the updated values back into the model's parameters."""

    @abc.abstractmethod
    def held(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """(parameter tensors, gradient tensors) this rank keeps alive, for memory accounting."""

    @abc.abstractmethod
    def optim_extras(self) -> list[torch.Tensor | None]:
        """Optimizer-side tensors beyond the inner state: fp32 masters, host gradient copies."""

    @abc.abstractmethod
    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """The model part of a checkpoint (template for ``dcp.load``)."""

    @abc.abstractmethod
    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Apply a (``dcp.load``-filled) :meth:`model_state`."""


def whole_model_state(model: nn.Module, named: list[NamedParam], pieces: ShardMesh) -> dict[str, Any]:
    """Stages 0-2 keep every parameter whole over dp: the model's buffers, and the trained
    parameters (as tp pieces where tensor parallelism split them). A tied parameter is stored
    once, under its first name, as ZeRO-3 stores it (its other names are not buffers)."""
    param_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    out: dict[str, Any] = {k: v for k, v in model.state_dict().items() if k not in param_names}
    for name, p in named:
        t = p.detach()
        out[name] = pieces.dtensor(t, name, t.shape) if pieces.active else t
    return out


@torch.no_grad()
def load_whole_model_state(model: nn.Module, state: dict[str, Any]) -> None:
    """``dcp.load`` filled the template in place; copy anything given as another tensor."""
    own = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, v in state.items():
        local = v.to_local() if hasattr(v, "to_local") else v
        if name in own and torch.is_tensor(local) and local.data_ptr() != own[name].data_ptr():
            own[name].detach().copy_(local)
