"""ZeRO-3: parameters sharded per parameter along dim 0 (FSDP2-style), gathered per unit.

:func:`shard_model` replaces every parameter of a model by this rank's rows of it (see
:mod:`hybridpar.parallel.zero.shard`; uneven sizes are padded). Parameters are grouped into *units*
(e.g. the embedding and each transformer block; whatever is left, such as the final norm and
output head, forms the root unit, as does a parameter two units share, like a head tied to the
embedding: the root is gathered through the whole forward and backward, so the shared parameter
is gathered once per pass for both uses and its gradient, summed over them by autograd, is
reduce-scattered once). A unit's full parameters exist only while it runs:

* forward: gathered just before the unit's forward (one all-gather per unit), freed right after
  it; the next unit's gather is started ahead (prefetch) so it overlaps this unit's compute;
* backward: gathered again when the gradient of the unit's output arrives, the previous unit
  prefetched once half of this unit's gradient elements are in (past the step's memory peak, at
  the start of the unit's backward), and freed once every parameter's gradient has been
  accumulated; the gradients are then reduce-scattered (asynchronously; one reduction in flight,
  waited before the next unit's backward) into this rank's shard and the full gradients dropped.

So per micro-batch each parameter crosses the wire in two all-gathers and one reduce-scatter:
under the ring model 3 (n-1)/n x bytes, 1.5x the 2 (n-1)/n x bytes of an all-reduce.

Inside ``no_sync`` the full gradients accumulate locally (as FSDP's no_sync) and are reduced on
the final micro-batch. Freed parameters keep their tensor objects, whose storage is resized to
zero, so tensors saved by autograd are refilled in place when the unit is gathered for
backward. Writes go through ``.data`` so autograd's version counters see no change.

Under pipeline parallelism the units are the rank's pipeline chunks instead
(:mod:`hybridpar.parallel.zero.zero3_pp`). A unit and its gather state: :mod:`hybridpar.parallel.zero.unit`.

The model must be sharded after its weights are initialized or loaded.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.zero.offload import DiskStore
from hybridpar.parallel.zero.shard import OuterSplit, ShardMesh
from hybridpar.parallel.zero.sync import GradientSync
from hybridpar.parallel.zero.unit import Unit, group_parameters


class ShardedModel(GradientSync):
    """Handle returned by :func:`shard_model`: hooks, units, and state-dict helpers."""

    #: whether gradients are reduced by the pipeline runner's stage hooks (ZeRO-3 under pp,
    #: :mod:`hybridpar.parallel.zero.zero3_pp`) rather than by per-parameter hooks that
    #: ``no_sync`` silences
    reduces_per_stage = False

    def __init__(self, model: nn.Module, axis: Axis, units: list[nn.Module],
                 reduce_dtype: torch.dtype | None = None, prefetch: bool = True,
                 outer: OuterSplit | None = None, skip: frozenset[int] = frozenset(), fp8_gather: bool = False) -> None:
        self.model, self.axis = model, axis
        self.sync = True
        self.prefetch = prefetch
        self.units: list[Unit] = []  # root first, then the given units in forward order
        self._hooks: list[RemovableHandle] = []
        self._inflight: Unit | None = None  # the unit whose reduce-scatter runs (one at a time)
        device = next((p.device.type for p in model.parameters()), "cpu")
        self._pieces = ShardMesh(axis, outer, device)
        self.active = axis.size > 1
        if not self.active:
            return
        prefix = {id(m): name for name, m in model.named_modules()}
        for u in units:
            if u is model or id(u) not in prefix:
                raise ValueError("ZeRO-3 units must be submodules of the model (the root unit holds the rest)")
        unit_ids = {id(u) for u in units}
        inside: dict[int, nn.Module] = {}
        for u in units:
            for m in u.modules():
                if m is not u and id(m) in unit_ids:
                    raise ValueError(f"ZeRO-3 unit {prefix[id(u)]!r} contains unit {prefix[id(m)]!r}; units must not nest")
                inside[id(m)] = u
        root = id(model)  # a parameter shared across units (a tied head) goes to the root unit: gathered
        groups = group_parameters(model, lambda mod: id(inside.get(id(mod), model)), skip,  # while either runs
                                  shared=lambda _keys: root)
        for u in [model, *units]:
            if groups.get(id(u)):
                self.units.append(Unit(prefix[id(u)] or "<root>", groups[id(u)], axis, reduce_dtype, fp8_gather))
        by_module = dict(zip([id(u) for u in [model, *units] if groups.get(id(u))], self.units, strict=True))
        order = [by_module[id(u)] for u in units if id(u) in by_module]
        root = by_module.get(id(model))
        self.forward_order = ([root] if root else []) + order
        self.backward_order = ([root] if root else []) + order[::-1]
        for module in [model, *units]:
            unit = by_module.get(id(module))
            if unit is None:
                continue
            self._hooks.append(module.register_forward_pre_hook(self._pre_forward_hook(unit)))
            self._hooks.append(module.register_forward_hook(self._post_forward_hook(unit)))
            for i, p in enumerate(unit.full):
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(unit, i)))

    # ------------------------------------------------------------------ hooks
    def _neighbour(self, unit: Unit, order: list[Unit]) -> Unit | None:
        k = order.index(unit) + 1
        return order[k] if k < len(order) else None

    def _pre_forward_hook(self, unit: Unit):
        def hook(_module: nn.Module, _args: Any) -> None:
            self._read_ahead(self._neighbour(unit, self.forward_order))
            unit.wait()
            nxt = self._neighbour(unit, self.forward_order)
            if nxt is not None and self.prefetch:
                nxt.unshard()
        return hook

    @staticmethod
    def _read_ahead(unit: Unit | None) -> None:
        """Parameter shards on disk: start reading the next unit's file while this one runs."""
        if unit is not None and unit.arena is not None:
            unit.arena.prefetch()

    def _post_forward_hook(self, unit: Unit):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            unit.reshard()
            if not torch.is_grad_enabled():
                return
            tensors = [t for t in _flatten(output) if t.requires_grad]
            if tensors:
                torch.autograd.graph.register_multi_grad_hook(tensors, lambda _g: self._pre_backward(unit), mode="any")
        return hook

    def _pre_backward(self, unit: Unit) -> None:
        self._drain()  # the unit before's reduction: out of the way before this unit's backward grows memory
        self._read_ahead(self._neighbour(unit, self.backward_order))
        unit.wait()
        prev = self._neighbour(unit, self.backward_order)
        if prev is not None and self.prefetch:
            unit.ahead = prev  # started by _grad_hook once half of this unit's gradients are in

    def _grad_arrived(self, unit: Unit) -> None:
        """Backward prefetch, issued once half of ``unit``'s gradient elements are in rather than
        at its start: a unit's backward begins at the step's memory peak (its activations and
        everyone's accumulated gradients alive) and frees activations as it goes, so the next
        unit's gather buffer lands after the peak, with half the backward left to overlap it.
        (``benchmarks/zero.py``: this is what keeps ZeRO-3's peak with prefetch <= FSDP2's.)"""
        nxt = unit.ahead
        if nxt is not None and 2 * sum(unit.full[i].numel() for i in unit.arrived) >= unit.trainable_numel:
            unit.ahead = None
            nxt.unshard()

    def _grad_hook(self, unit: Unit, i: int):
        def hook(_p: torch.Tensor) -> None:
            unit.grads.note_grad()
            unit.arrived.add(i)
            self._grad_arrived(unit)
            if unit.trainable <= unit.arrived:
                unit.arrived.clear()
                unit.reshard()
                if self.sync:
                    self._reduce(unit)
        return hook

    def _reduce(self, unit: Unit) -> None:
        """Start ``unit``'s gradient reduce-scatter once all its gradients are in and its full
        parameters are freed (as FSDP2's post-backward: the staging buffer never meets them),
        after waiting for the one before: it has had the unit's whole backward to finish, and
        waiting frees its staging buffer, so one is alive at a time instead of every unit's
        until the end of backward. (Measured by ``benchmarks/zero.py``'s peak, with prefetch.)"""
        self._drain()
        unit.grads.note_grad()
        unit.grads.launch()
        self._inflight = unit

    def _drain(self) -> None:
        """Wait for the reduction in flight (if any) and free its staging buffer."""
        if self._inflight is not None:
            self._inflight.grads.finish()
            self._inflight = None

    # ------------------------------------------------------------------ steps
    def finish(self) -> None:
        """Free anything still gathered, reduce-scatter what has not been, and wait for all of it."""
        self._inflight = None
        for unit in self.forward_order:
            unit.reshard()
            unit.arrived.clear()
            unit.ahead = None
        for unit in self.backward_order:
            unit.grads.finish()
            for shard, grad in zip(unit.shards, unit.grads.views(), strict=True):
                if grad is None or grad.device == shard.device:  # offloaded shards: the optimizer copies
                    shard.grad = grad

    def offload_params(self, store: DiskStore | None, pin: bool = False) -> None:
        """Keep every unit's shard off the compute device: in host memory (``store`` None;
        pinned with ``pin``) or in memory-mapped files of ``store``. Gathers copy the shard to
        the device first; with files, the next unit's is read ahead and each is dropped from
        memory once gathered. The optimizer must step on the host (``offload``)."""
        for i, unit in enumerate(self.units):
            if store is None:
                unit.move_shard(torch.empty(unit.layout.size, dtype=unit.dtype, pin_memory=pin))
            else:
                if unit.dtype != torch.float32:
                    raise ValueError(f"parameter offload to disk keeps fp32 shards; unit {unit.name!r} is {unit.dtype}")
                arena = store.arena(f"params{i}", unit.layout.size)
                unit.move_shard(arena.tensor, arena)

    def evict(self) -> None:
        """Parameter shards on disk: write them back and drop them from memory (after a step)."""
        for unit in self.units:
            if unit.arena is not None:
                unit.arena.evict()

    def whole_model(self) -> contextlib.AbstractContextManager[None]:
        """A block that runs the whole model outside the training step (sampling): each unit's
        forward hooks gather it as it runs, so nothing more is needed here (:class:`StageSharded`,
        whose hooks are the pipeline runner's, gathers every unit)."""
        return contextlib.nullcontext()

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.grads.zero()
            for shard in unit.shards:
                shard.grad = None

    def remove(self) -> None:
        """Remove the hooks (the model keeps its shards)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ state
    def gather_full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter (and buffer) in full, on every rank: one all-gather per unit."""
        if not self.active:
            return {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        full: dict[str, torch.Tensor] = {}
        for unit in self.units:
            buf = torch.empty(unit.layout.n * unit.layout.size, dtype=unit.dtype, device=unit.device)
            self.axis.comm.all_gather_into(buf, unit.shard_flat.to(unit.device), self.axis)
            for i, (fqn, p) in enumerate(zip(unit.fqns, unit.full, strict=True)):
                full[fqn] = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                unit.layout.unpack(buf, i, full[fqn])
        for unit in self.units:  # a tied parameter under each of its names, one tensor (as model.state_dict())
            full.update({alias: full[fqn] for alias, fqn in unit.aliases.items()})
        params = dict(self.model.named_parameters(remove_duplicate=False))
        names = list(params) + [k for k, _ in self.model.named_buffers()]
        others = dict(self.model.named_buffers()) | params  # buffers, skipped ones
        return {k: full[k] if k in full else others[k].detach().clone() for k in names}

    def state_dict(self) -> dict[str, Any]:
        """The model state for ``torch.distributed.checkpoint``: each parameter a ``DTensor``
        (``Shard(0)`` over dp, inside the tp split if any) viewing this rank's rows, so each rank
        writes only its shard and a load at another layout reads the rows it needs. Loading
        writes in place."""
        if not self.active:
            return self.model.state_dict()
        out: dict[str, Any] = {}
        for unit in self.units:
            for fqn, p, shard in zip(unit.fqns, unit.full, unit.shards, strict=True):
                out[fqn] = self._pieces.dtensor(shard.detach(), fqn, p.shape)
        out.update({k: v for k, v in self.model.named_buffers()})
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Copy parameters in: ``DTensor`` shards or full tensors (this rank keeps its rows)."""
        if not self.active:
            self.model.load_state_dict(state)
            return
        with torch.no_grad():
            for unit in self.units:
                for i, (fqn, shard) in enumerate(zip(unit.fqns, unit.shards, strict=True)):
                    if fqn not in state:
                        raise KeyError(f"state dict has no entry for parameter {fqn}")
                    v = state[fqn]
                    local = v.to_local() if hasattr(v, "to_local") else v[slice(*unit.layout.local_rows(i))]
                    if local.data_ptr() != shard.data_ptr():
                        shard.detach().copy_(local)

    def memory(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """(parameter tensors, gradient tensors) held by all units."""
        params: list[torch.Tensor | None] = []
        grads: list[torch.Tensor | None] = []
        for unit in self.units:
            p, g = unit.held()
            params += p
            grads += g
        return params, grads


def shard_model(model: nn.Module, axis: Axis, units: list[nn.Module],
                reduce_dtype: torch.dtype | None = None, prefetch: bool = True,
                outer: OuterSplit | None = None, skip: frozenset[int] = frozenset(),
                fp8_gather: bool = False) -> ShardedModel:
    """Shard ``model``'s parameters over ``axis`` (dp) for ZeRO-3; ``units`` are the modules
    gathered as one (in forward order); parameters outside them form the root unit. On a size-1
    axis nothing changes. ``reduce_dtype`` compresses the gradient reduce-scatter (bf16/fp16).
    ``prefetch`` starts the next unit's gather while this one computes (faster, one more unit
    of memory); without it a unit is gathered only when it runs. ``outer``: the parameters are
    tensor-parallel pieces (see :class:`~hybridpar.parallel.zero.shard.OuterSplit`). ``skip``: ids of
    parameters left alone (sharded by another :class:`ShardedModel` over another axis: experts).
    ``fp8_gather``: tensorwise FP8 linears' weights are gathered in FP8
    (:mod:`hybridpar.parallel.zero.fp8_gather`, ``fp8.all_gather``)."""
    return ShardedModel(model, axis, units, reduce_dtype, prefetch, outer, skip, fp8_gather)


def _flatten(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, list | tuple):
        return [t for o in output for t in _flatten(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _flatten(o)]
    return []
