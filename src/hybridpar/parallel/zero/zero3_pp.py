"""ZeRO-3 under pipeline parallelism: one unit per pipeline chunk, gathered once per step.

Under pipeline parallelism (:func:`shard_stages`, :class:`StageSharded`) the units are the
rank's pipeline chunks, gathered once per step by the pipeline runner's stage hooks and kept
through all micro-batches (FSDP's ``reshard_after_forward=False`` under pipelining): per step
each parameter crosses the wire in one all-gather and one reduce-scatter (not two all-gathers
per micro-batch as :class:`~hybridpar.parallel.zero.zero3.ShardedModel` does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.zero.shard import OuterSplit
from hybridpar.parallel.zero.unit import Unit, group_parameters
from hybridpar.parallel.zero.zero3 import ShardedModel


class StageSharded(ShardedModel):
    """ZeRO-3 under pipeline parallelism (FSDP's ``reshard_after_forward=False`` within a step):
    one unit per pipeline chunk of this rank (its parameters under the model's names; a
    parameter two local chunks share, like ZBV's tied embedding, or registered on modules of two
    chunks, belongs to the first, and both chunks read it). The
    :class:`~hybridpar.parallel.pipeline.runtime.PipelineRunner` calls :meth:`before_first` ahead
    of a chunk's first action of a step, which gathers the units the chunk reads (one all-gather
    each), and :meth:`after_last` after its last one (the last B, or W with a split backward),
    which reshards them once no other local chunk still reads them. So each chunk's parameters
    cross the wire once per step, not twice per micro-batch; gradients accumulate unsharded over
    the micro-batches and each unit is reduce-scattered once, asynchronously, right after its
    last backward (inside ``no_sync``: at :meth:`finish`). No module or gradient hooks: the
    runner's schedule knows when a chunk is first and last used, autograd does not.

    ``hold``: ids of parameters something reads after the pipeline (a tied embedding whose two
    copies' gradients are summed over pp): their units stay gathered, gradients unreduced,
    until :meth:`finish`."""

    reduces_per_stage = True

    def __init__(self, model: nn.Module, axis: Axis, chunks: Sequence[nn.Module],
                 reduce_dtype: torch.dtype | None = None, outer: OuterSplit | None = None,
                 hold: frozenset[int] = frozenset(), fp8_gather: bool = False) -> None:
        super().__init__(model, axis, [], reduce_dtype, prefetch=False, outer=outer, skip=frozenset(
            id(p) for p in model.parameters()))  # the base builds nothing: every parameter skipped
        self.forward_order, self.backward_order = [], []
        self._reads: dict[int, list[Unit]] = {}  # id(chunk) -> the units it reads
        self._held: set[int] = set()  # ids of units released only by finish()
        self._users: dict[int, set[int]] = {}  # id(unit) -> local chunks gathered and not yet done
        if not self.active:
            return
        first: dict[int, int] = {}
        for v, chunk in enumerate(chunks):
            for m in chunk.modules():
                first.setdefault(id(m), v)
        groups = group_parameters(model, lambda mod: first.get(id(mod)), shared=min)  # shared: the first chunk's
        group_of = {id(e.param): v for v, entries in groups.items() for e in entries}
        reads = [sorted({group_of[id(p)] for p in chunk.parameters() if id(p) in group_of}) for chunk in chunks]
        by_group: dict[int, Unit] = {}
        for v, chunk in enumerate(chunks):
            if v in groups:
                stage = getattr(getattr(chunk, "spec", None), "stage", v)
                by_group[v] = Unit(f"stage{stage}", groups[v], axis, reduce_dtype, fp8_gather)
                self.units.append(by_group[v])
                if any(id(e.param) in hold for e in groups[v]):
                    self._held.add(id(by_group[v]))
        self.forward_order, self.backward_order = list(self.units), list(self.units)
        self._reads = {id(chunk): [by_group[g] for g in gs] for chunk, gs in zip(chunks, reads, strict=True)}

    def before_first(self, chunk: nn.Module) -> None:
        """Before ``chunk``'s first action of a step: gather what it reads (all gathers in flight
        at once), unless already gathered for another local chunk."""
        units = self._reads.get(id(chunk), [])
        for unit in units:
            unit.unshard()
        for unit in units:
            unit.wait()
            self._users.setdefault(id(unit), set()).add(id(chunk))

    def after_last(self, chunk: nn.Module, backward: bool) -> None:
        """After ``chunk``'s last action of a step (``backward``: the step trained it): reshard
        each unit no other local chunk still reads and start its gradient reduce-scatter."""
        for unit in self._reads.get(id(chunk), []):
            users = self._users.get(id(unit), set())
            users.discard(id(chunk))
            if users or (backward and id(unit) in self._held):
                continue
            unit.reshard()
            if backward and self.sync and any(p.grad is not None for p in unit.full):
                self._reduce(unit)

    def finish(self) -> None:
        """Reshard held units and reduce every gradient not reduced yet (``no_sync`` steps,
        held units), then wait for all of it."""
        self._users.clear()
        for unit in self.units:
            if any(p.grad is not None for p in unit.full):
                unit.grads.note_grad()
        super().finish()

    def whole_model(self) -> contextlib.AbstractContextManager[None]:
        """Every unit gathered (:meth:`gathered`): the runner's stage hooks do not run outside a step."""
        return self.gathered()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit gathered for the block (sampling through the whole model), then resharded."""
        for unit in self.units:
            unit.unshard()
        try:
            for unit in self.units:
                unit.wait()
            yield
        finally:
            for unit in self.units:
                unit.reshard()


def shard_stages(model: nn.Module, axis: Axis, chunks: Sequence[nn.Module], reduce_dtype: torch.dtype | None = None,
                 outer: OuterSplit | None = None, hold: frozenset[int] = frozenset(),
                 fp8_gather: bool = False) -> StageSharded:
    """ZeRO-3 of the pipeline ``chunks`` this rank runs (module doc of :class:`StageSharded`);
    hand the result to the runner as its ``stage_hooks``. Parameters outside the chunks (other
    stages') are left alone. ``fp8_gather``: as :func:`~hybridpar.parallel.zero.zero3.shard_model`'s."""
    return StageSharded(model, axis, chunks, reduce_dtype, outer, hold, fp8_gather)
