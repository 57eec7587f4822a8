"""A component: everything of one feature in one class (in the spirit of torchtitan's
``components/float8.py``).

A :class:`Component` owns one feature's parts:

- whether a run has it: :meth:`Component.enabled` from the config (and the launch), decided once
  when :func:`hybridpar.training.features.components_for` builds the run's components;
- its build steps, called by :class:`hybridpar.training.engine.Engine` at fixed points of the
  build, each given what it works on explicitly (:meth:`~Component.parallelize` after tensor
  parallelism, :meth:`~Component.convert_blocks` after context parallelism,
  :meth:`~Component.wrap_chunks` after the pipeline cut);
- its wiring into the step (:meth:`~Component.attach`, given a :class:`RunContext` once the
  Trainer exists), its step hooks (:class:`~hybridpar.training.features.base.StepFeature`) and
  its state (``state_dict``, checkpointed with the Trainer's).

:class:`Components` holds a run's components in the registry's order (checked at import,
:func:`hybridpar.training.features.registry.check_order`) and calls each build step and hook on
all of them in that order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch
from torch import nn

from hybridpar.config import Config
from hybridpar.distributed.mesh import Topology
from hybridpar.training.elastic import LayoutChange
from hybridpar.training.features.base import StepFeature, StepHooks

if TYPE_CHECKING:
    from hybridpar.models.registry import Family
    from hybridpar.training.engine import Engine

__all__ = ["Component", "Components", "Launch", "RunContext"]

C = TypeVar("C", bound="Component")


@dataclass(frozen=True)
class Launch:
    """What a run takes from its launch rather than its config: an elastic job's layout for this
    world (``hybridpar train --elastic``; None otherwise)."""

    elastic: LayoutChange | None = None


@dataclass(frozen=True)
class RunContext:
    """What a component's step hooks may use, given once the Trainer is built: the built
    ``engine``, the run's ``topo`` and ``device``, its directory (``is_logger``: this rank
    writes it), ``read(step)``: this rank's micro-batches of a step, ``timeout_s``, the list the
    run's checkpoint stalls are recorded in, whether a component of the run rewrites
    checkpointed state in its backward (:class:`Components` sets it), and the trainer's state
    beyond model and optimizer as a checkpoint holds it (``extra_state()``)."""

    engine: Engine
    topo: Topology
    device: torch.device
    run_dir: Path
    is_logger: bool
    read: Callable[[int], list[tuple]]
    timeout_s: float
    checkpoint_stalls: list[tuple[int, float]]
    backward_writes_checkpoint_state: bool = False
    extra_state: Callable[[], dict[str, Any]] | None = None  # the trainer's state beyond model and optimizer


class Component(StepFeature):
    """One feature (module doc). Subclasses set :attr:`name`, override :meth:`enabled` and only
    the build steps and hooks they need (each a no-op here)."""

    #: the feature's name in the registry and in :attr:`after` of others
    name: ClassVar[str]
    #: names of components that, when a run has them, must come before this one (their build
    #: steps and hooks run first); the registry's order is checked against it at import
    after: ClassVar[tuple[str, ...]] = ()

    def __init__(self, cfg: Config, launch: Launch) -> None:
        self.cfg = cfg

    @classmethod
    def enabled(cls, cfg: Config, launch: Launch) -> bool:
        """Whether a run under ``cfg`` (launched as ``launch``) has this feature."""
        raise NotImplementedError(f"{cls.__name__}.enabled")

    # ------------------------------------------------------------------ build steps (the Engine's)
    def parallelize(self, model: nn.Module, topo: Topology, family: Family, sequence_parallel: bool) -> None:
        """After tensor parallelism, before the weights load: shard what the feature adds."""

    def convert_blocks(self, blocks: list[nn.Module], topo: Topology, device: torch.device) -> None:
        """After context parallelism, before recomputation: change the model's blocks."""

    def wrap_chunks(self, runs: list[list[nn.Module]], device: torch.device) -> None:
        """After the pipeline cut, before the optimizer: ``runs`` are the blocks of each of this
        rank's pipeline chunks (the whole model's at pp=1), in order."""

    # ------------------------------------------------------------------ the step's wiring
    def attach(self, run: RunContext) -> None:
        """Once the Trainer exists: take what the step hooks use from ``run``."""


class Components(StepHooks):
    """A run's components in registry order: each build step and hook called on all of them."""

    def __init__(self, components: Sequence[Component]) -> None:
        super().__init__(components)
        self.components = self.features  # one list: a feature added later joins the hooks too

    def find(self, kind: type[C]) -> C | None:
        """The run's component of type ``kind`` (None: the run does not have that feature)."""
        return next((c for c in self.components if isinstance(c, kind)), None)

    def _built(self) -> list[Component]:
        return [c for c in self.components if isinstance(c, Component)]

    def names(self) -> list[str]:
        return [c.name for c in self.components if isinstance(c, Component)]

    def parallelize(self, model: nn.Module, topo: Topology, family: Family, sequence_parallel: bool) -> None:
        for c in self._built():
            c.parallelize(model, topo, family, sequence_parallel)

    def convert_blocks(self, blocks: list[nn.Module], topo: Topology, device: torch.device) -> None:
        for c in self._built():
            c.convert_blocks(blocks, topo, device)

    def wrap_chunks(self, runs: list[list[nn.Module]], device: torch.device) -> None:
        for c in self._built():
            c.wrap_chunks(runs, device)

    def attach(self, run: RunContext) -> None:
        """Every component's :meth:`Component.attach`, told whether any of them rewrites
        checkpointed state in its backward."""
        writes = any(c.backward_writes_checkpoint_state for c in self.components)
        run = dataclasses.replace(run, backward_writes_checkpoint_state=writes)
        for c in self._built():
            c.attach(run)
