"""The three ZeRO stage families behind :class:`~hybridpar.parallel.zero.optimizer.ZeroOptimizer`.

Each family is one strategy object that owns the per-stage concerns of the step protocol, so
the optimizer wrapper has one code path per concern instead of a branch on the stage in every
method:

- :class:`Replicated` (stage 0, and every stage on a size-1 dp axis without offload): plain
  bucketed data parallel through :class:`~hybridpar.parallel.zero.reducer.GradientReducer`; fp32
  master copies for bf16/fp16 parameters; optional two-level (``hierarchy``) all-reduce.
- :class:`ShardedState` (stages 1 and 2): parameters cut into buckets, each a
  :class:`~hybridpar.parallel.zero.shard.GradShard` that reduce-scatters the gradients into this
  rank's rows (stage 1 keeps the full gradient buffer, ``keep_full``); the inner optimizer
  updates those rows, then one all-gather per bucket makes the parameters whole again.
- :class:`ShardedParams` (stage 3): the units of a
  :class:`~hybridpar.parallel.zero.zero3.ShardedModel`, which gathers parameters and
  reduce-scatters gradients itself; the inner optimizer updates the shards in place.

Every strategy answers the same questions (:class:`~hybridpar.parallel.zero.stage.ZeroStage`): what the inner optimizer
steps for each parameter (a :class:`~hybridpar.parallel.zero.stage.Slot`), how ``no_sync``/``zero_grad``/``finish`` treat the
gradients, which gradient tensors this rank holds, whether the gradient norm still needs a sum
over dp, how gradients reach the inner optimizer and updates reach the model, what memory it
keeps, and what the model part of a checkpoint is. The wrapper keeps checkpoint formatting
(keyed by :class:`~hybridpar.parallel.zero.stage.Slot`), validation and the inner optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from hybridpar.distributed.comm import Pending
from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.zero.reducer import GradientReducer, cut_buckets, param_bytes
from hybridpar.parallel.zero.replicate import Replicas
from hybridpar.parallel.zero.shard import GradShard, OuterSplit, ShardLayout, ShardMesh
from hybridpar.parallel.zero.stage import (
    LOW_PRECISION,
    NamedParam,
    ShardGroup,
    Slot,
    ZeroStage,
    load_whole_model_state,
    whole_model_state,
)
from hybridpar.parallel.zero.zero3 import ShardedModel


class Replicated(ZeroStage):
    """Stage 0: every rank keeps everything; gradients are all-reduced in buckets during backward
    (two-level with ``hierarchy``). bf16/fp16 parameters get fp32 master copies the inner
    optimizer steps, copied back after each step. On a size-1 axis no hooks are installed."""

    def __init__(self, named: list[NamedParam], axis: Axis, bucket_bytes: int,
                 hierarchy: tuple[Axis, Axis] | None, outer: OuterSplit | None, int8: bool = False) -> None:
        super().__init__(named, axis)
        self.params = [p for _, p in named]
        self.reducer = GradientReducer(self.params, axis, bucket_bytes, hierarchy, int8)
        self.masters: dict[int, nn.Parameter] = {}
        self._synced: set[int] = set()  # GradientReducer cannot take a 2nd pass outside no_sync
        self._finished = False  # GradientReducer.finish divides by N: only once per step
        for p in self.params:
            if axis.size > 1 and p.requires_grad:
                self.hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
            opt = p
            if p.dtype in LOW_PRECISION:
                opt = self.masters[id(p)] = nn.Parameter(p.detach().float().clone(), requires_grad=False)
            self.slots[id(p)] = Slot(opt, opt.shape, None, None if opt is p else p)
        self._param_pieces = ShardMesh(None, outer, named[0][1].device.type)

    @property
    def state_axis(self) -> Axis | None:
        return None

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.sync:
            return
        if id(p) in self._synced:
            raise RuntimeError("ZeRO-0 (plain data parallel) reduces each step's gradients once: run every "
                               "backward but the last of a step inside no_sync(), then step(), then zero_grad()")
        self._synced.add(id(p))

    def _quiet(self) -> AbstractContextManager[None]:
        return self.reducer.no_sync()

    def zero_grad(self) -> None:
        """Bucket views are zeroed in place (the all-reduce reads them); with nothing to reduce the
        gradients are dropped, so the first backward of a step stores its gradients instead of
        adding them to zeros (no memset, no read-modify-write: what ``set_to_none`` saves)."""
        self._finished = False
        self._synced.clear()
        bucketed = bool(self.reducer.buckets)
        for p in self.params:
            if p.grad is not None:
                if bucketed:
                    p.grad.zero_()
                else:
                    p.grad = None
        for m in self.masters.values():
            m.grad = None

    def finish(self) -> None:
        if not self._finished:
            self.reducer.finish()
            for p in self.params:  # a parameter no micro-batch reached steps on a zero gradient, as
                if p.grad is None and p.requires_grad:  # under data parallelism (bucket views)
                    p.grad = torch.zeros_like(p)
        self._finished = True

    def grad_views(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p.grad) for n, p in self.named if p.grad is not None]

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def residuals(self) -> list[torch.Tensor]:
        return self.reducer.residuals()

    def sum_over_dp(self, total: torch.Tensor) -> None:
        """Nothing to do: every rank already holds the whole averaged gradient."""

    def load_grads(self) -> None:
        for p in self.params:
            if id(p) in self.masters:
                self.masters[id(p)].grad = None if p.grad is None else p.grad.float()

    def store_updates(self) -> None:
        for p in self.params:
            if id(p) in self.masters:
                p.copy_(self.masters[id(p)])
                self.masters[id(p)].grad = None

    def held(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        return list(self.params), [b.buffer for b in self.reducer.buckets] + [p.grad for p in self.params]

    def optim_extras(self) -> list[torch.Tensor | None]:
        return list(self.masters.values())

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        return whole_model_state(model, self.named, self._param_pieces)

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        load_whole_model_state(model, state)


class _Grouped(ZeroStage):
    """Stages 1-3: the inner optimizer steps this rank's rows of each :class:`ShardGroup`
    (or their fp32 masters, on the host with ``offload``); the gradient norm's local sum of
    squares covers only those rows, so it is all-reduced over dp."""

    def __init__(self, named: list[NamedParam], axis: Axis, offload: bool) -> None:
        super().__init__(named, axis)
        self.offload = offload
        self._place: dict[int, tuple[ShardGroup, int]] = {}

    def _needs_master(self, dtype: torch.dtype) -> bool:
        return self.offload or dtype in LOW_PRECISION

    def _add(self, g: ShardGroup, params: list[nn.Parameter]) -> None:
        """Register group ``g`` whose ``i``-th row set belongs to ``params[i]``."""
        self.groups.append(g)
        for i, p in enumerate(params):
            self.slots[id(p)] = g.slot(i)
            self._place[id(p)] = (g, i)

    @property
    def state_axis(self) -> Axis | None:
        return self.axis

    def _clear_opt_grads(self, g: ShardGroup) -> None:
        for opt in g.opt:
            opt.grad = None

    def grad_views(self) -> list[torch.Tensor]:
        return [v for g in self.groups for v in g.grads.views() if v is not None]

    def named_grads(self) -> list[tuple[str, torch.Tensor]]:
        views = {id(g): g.grads.views() for g in self.groups}
        by_name = {name: views[id(g)][i] for name, p in self.named for g, i in [self._place[id(p)]]}
        return [(n, v) for n, v in by_name.items() if v is not None]

    @property
    def device(self) -> torch.device:
        return self.groups[0].values[0].device

    def sum_over_dp(self, total: torch.Tensor) -> None:
        self.axis.comm.all_reduce(total, self.axis)

    def load_grads(self) -> None:
        for g in self.groups:
            self.load_group(g)

    def load_group(self, g: ShardGroup) -> None:
        """Hand group ``g``'s reduced gradients to the tensors the inner optimizer steps."""
        grads = g.grads.views()
        if g.master_flat is None:
            for opt, grad in zip(g.opt, grads, strict=True):
                opt.grad = grad
            return
        buf = g.host_grad if g.host_grad is not None else torch.empty(
            g.layout.size, dtype=torch.float32, device=g.master_flat.device)
        for opt, grad, view in zip(g.opt, grads, g.layout.views(buf), strict=True):
            if grad is not None:
                view.copy_(grad)
            opt.grad = None if grad is None else view

    def store_updates(self) -> None:
        """Copy updated masters back into this rank's rows (without masters they were stepped
        in place), then :meth:`finish_updates`."""
        for g in self.groups:
            self.store_group(g)
        self.finish_updates()

    def store_group(self, g: ShardGroup) -> None:
        """Group ``g``'s updated masters back into this rank's rows."""
        if g.master_flat is not None:
            for v, opt in zip(g.values, g.opt, strict=True):
                v.copy_(opt)
                opt.grad = None

    def finish_updates(self) -> None:
        """After every group's :meth:`store_group`: whatever the stage does with the updated rows."""

    def optim_extras(self) -> list[torch.Tensor | None]:
        return [t for g in self.groups for t in (g.master_flat, g.host_grad)]


class ShardedState(_Grouped):
    """Stages 1 and 2: parameters stay whole on every rank; gradients are reduce-scattered per
    bucket (:class:`GradShard`, started by hooks during backward) into this rank's rows, which
    the inner optimizer updates; then one all-gather per bucket makes the parameters whole.
    Stage 1 (``keep_full``) keeps a persistent full gradient buffer whose own rows receive the
    reduced gradient; stage 2 keeps only the reduced rows."""

    def __init__(self, named: list[NamedParam], axis: Axis, bucket_bytes: int, *, keep_full: bool,
                 reduce_dtype: torch.dtype | None, offload: bool, outer: OuterSplit | None,
                 replicas: Replicas | None = None) -> None:
        super().__init__(named, axis, offload)
        self.params = [p for _, p in named]
        for bucket in buckets(self.params, bucket_bytes):
            layout = ShardLayout([p.shape for p in bucket], axis.size, axis.rank)
            values = [p.detach()[slice(*layout.local_rows(i))] for i, p in enumerate(bucket)]
            grads = GradShard(layout, bucket, axis, keep_full=keep_full, reduce_dtype=reduce_dtype, replicas=replicas)
            self._add(ShardGroup(layout, values, grads, bucket, self._needs_master(bucket[0].dtype), offload), bucket)
            for i, p in enumerate(bucket):
                if keep_full and p.grad is None:
                    p.grad = torch.zeros_like(p)  # ZeRO-1's persistent full gradient buffer
                if p.requires_grad:
                    self.hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(grads, i)))
        self._param_pieces = ShardMesh(None, outer, named[0][1].device.type)
        self._in_flight: GradShard | None = None  # the bucket whose reduce-scatter runs now

    def _grad_hook(self, grads: GradShard, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_p: torch.Tensor) -> None:
            grads.note_grad()
            if self.sync:
                grads.on_grad(i)
                if grads.in_flight and self._in_flight is not grads:
                    self._one_in_flight(grads)
        return hook

    def _one_in_flight(self, grads: GradShard) -> None:
        """A bucket just started its reduce-scatter: end the previous one's (it had this bucket's
        backward to finish in), so its staging buffer, the size of the bucket's full gradients,
        is freed. Without this every bucket's staging stayed until the step's end, and ZeRO-2
        held a full gradient's worth at the peak, like ZeRO-1."""
        if self._in_flight is not None:
            self._in_flight.finish()
        self._in_flight = grads

    def zero_grad(self) -> None:
        self._in_flight = None
        for g in self.groups:
            g.grads.zero()
            self._clear_opt_grads(g)

    def finish(self) -> None:
        self._in_flight = None
        for g in self.groups:
            g.grads.finish()

    def finish_updates(self) -> None:
        """Every rank's updated rows into every full parameter."""
        inflight: list[tuple[ShardGroup, torch.Tensor, Pending]] = []
        for g in self.groups:
            send = torch.empty(g.layout.size, dtype=g.full[0].dtype, device=g.full[0].device)
            for view, v in zip(g.layout.views(send), g.values, strict=True):
                view.copy_(v)
            out = torch.empty(g.layout.n * g.layout.size, dtype=send.dtype, device=send.device)
            inflight.append((g, out, self.axis.comm.all_gather_into(out, send, self.axis, async_op=True)))
        for g, out, pending in inflight:
            pending.wait()
            for i, p in enumerate(g.full):
                g.layout.unpack(out, i, p.detach())

    def held(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        return list(self.params), [t for g in self.groups for t in g.grads.held_tensors()]

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        return whole_model_state(model, self.named, self._param_pieces)

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        load_whole_model_state(model, state)


class ShardedParams(_Grouped):
    """Stage 3: one group per unit of the :class:`ShardedModel`, which gathers parameters around
    each unit's forward/backward and reduce-scatters its gradients; the inner optimizer updates
    the unit shards (the model's parameters between forwards) in place or through masters.
    ``named`` must be the sharded model's parameters; ``replicas``: hybrid sharding's replicas
    of every unit's shard (their gradients summed over them too)."""

    def __init__(self, named: list[NamedParam], axis: Axis, sharded: ShardedModel,
                 reduce_dtype: torch.dtype | None, offload: bool, replicas: Replicas | None = None) -> None:
        super().__init__(named, axis, offload)
        owner = {id(s) for u in sharded.units for s in u.shards}
        for name, p in named:
            if id(p) not in owner:
                raise ValueError(f"parameter {name} is not a shard of the sharded model; build the "
                                 "optimizer from the model's parameters after shard_model()")
        self.sharded = sharded
        for u in sharded.units:
            if reduce_dtype is not None:  # compression may be asked here or in shard_model()
                u.grads.compress(reduce_dtype)
            u.grads.replicate(replicas)
            self._add(ShardGroup(u.layout, list(u.shards), u.grads, None, self._needs_master(u.dtype), offload),
                      list(u.shards))

    def _quiet(self) -> AbstractContextManager[None]:
        return self.sharded.no_sync()

    def zero_grad(self) -> None:
        self.sharded.zero_grad()
        for g in self.groups:
            self._clear_opt_grads(g)

    def finish(self) -> None:
        self.sharded.finish()

    def held(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        return self.sharded.memory()

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        return self.sharded.state_dict()  # the units know the model's parameters and buffers

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        self.sharded.load_state_dict(state)


def buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """:func:`~hybridpar.parallel.zero.reducer.cut_buckets`, also cut wherever dtype or device changes."""
    return cut_buckets(params, param_bytes, bucket_bytes,
                       lambda first, p: p.dtype == first.dtype and p.device == first.device)
