"""The dry run's memory measure: peak live tensor bytes of one training step, by kind, beside
the planner's tensor term.

:class:`LiveBytes` follows every tensor storage created while it is active (fake ones included:
a fake storage has its size, not its memory), through its resizes (ZeRO-3 frees and refills a
gathered parameter in place) to its release. It is entered before the trainer is built, so all
the rank holds is counted. At the measured step's start (:meth:`LiveBytes.mark`) what is alive
is sorted into ``params`` (the model's parameters and buffers), ``grads`` (their ``.grad``),
``optimizer`` (created inside an optimizer's ``step``) and ``buffers`` (the rest: ZeRO's flat
shards and gradient buckets, communication buffers); what the step creates is ``activations``
(saved tensors, temporaries, gathered parameters, messages in flight). The split is read at
the step's peak of the total.

torch's own ``MemTracker`` does the same over module hooks, but refuses a module called twice in
a step (every micro-batch of a pipeline) and cannot see ZeRO's flat buffers as gradients.

The planner's tensor term is :func:`hybridpar.planner.memory.plan.rank_memory`'s components without
``overhead``: the allocator's extra (fragmentation, caching, the CUDA context and communicator
buffers) is the planner's own, separate term (:mod:`hybridpar.planner.machine.allocator`), which no fake
tensor can show.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.config import ModelConfig
from hybridpar.planner.memory.plan import rank_memory
from hybridpar.planner.model.layout import Layout, Workload

KINDS = ("params", "grads", "optimizer", "buffers", "activations")


class _Storage:
    """One tracked storage: its bytes now and its kind."""

    __slots__ = ("kind", "nbytes", "ref")

    def __init__(self, nbytes: int, kind: str) -> None:
        self.nbytes, self.kind, self.ref = nbytes, kind, None


class LiveBytes(TorchDispatchMode):
    """Live tensor bytes by kind, and the peak since :meth:`mark` (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.current: Counter[str] = Counter()
        self.total = 0
        self.peak: dict[str, int] = {}
        self.peak_total = 0
        self._kind = "buffers"  # of storages created now
        self._hooks: list[Any] = []
        self._resize: Any = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t.untyped_storage())
        return out

    def _track(self, st: torch.UntypedStorage) -> None:
        rec = self.storages.get(st)
        if rec is None:
            rec = _Storage(0, "optimizer" if self._kind == "in-optimizer" else self._kind)
            rec.ref = weakref.ref(st, lambda _, rec=rec: self._set(rec, 0))
            self.storages[st] = rec
        self._set(rec, st.nbytes())

    def _set(self, rec: _Storage, nbytes: int) -> None:
        change, rec.nbytes = nbytes - rec.nbytes, nbytes
        self.current[rec.kind] += change
        self.total += change
        if self.total > self.peak_total:
            self.peak_total, self.peak = self.total, dict(self.current)

    def mark(self, model: nn.Module) -> None:
        """Sort what is alive into kinds, start a new peak, and tag what follows activations."""
        params = {id(p.untyped_storage()) for p in [*model.parameters(), *model.buffers()]}
        grads = {id(p.grad.untyped_storage()) for p in model.parameters() if p.grad is not None}
        self.current = Counter()
        for st, rec in list(self.storages.items()):
            if rec.kind != "optimizer":
                rec.kind = "grads" if id(st) in grads else "params" if id(st) in params else "buffers"
            self.current[rec.kind] += rec.nbytes
        self.peak_total, self.peak = self.total, dict(self.current)
        self._kind = "activations"

    def __enter__(self) -> LiveBytes:
        def pre(*_: Any) -> None:
            self._kind, self._outside = "in-optimizer", self._kind

        def post(*_: Any) -> None:
            self._kind = self._outside

        self._hooks = [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
        self._resize = resize = torch.UntypedStorage.resize_

        def tracked_resize(st: torch.UntypedStorage, size: int) -> Any:
            out = resize(st, size)
            self._track(st)
            return out

        torch.UntypedStorage.resize_ = tracked_resize  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        for h in self._hooks:
            h.remove()
        super().__exit__(*exc)

    def measured(self) -> dict[str, int]:
        """The peak since :meth:`mark`: bytes per kind and ``total``."""
        return {**{k: int(self.peak.get(k, 0)) for k in KINDS}, "total": int(self.peak_total)}


def planned_memory(model: ModelConfig, layout: Layout, work: Workload, pp_rank: int) -> dict[str, float]:
    """The planner's memory terms for pipeline rank ``pp_rank`` and ``tensors``, their sum without
    the allocator's ``overhead``."""
    parts = dict(rank_memory(model, layout, work, pp_rank).components)
    parts["tensors"] = sum(v for k, v in parts.items() if k != "overhead")
    return parts
