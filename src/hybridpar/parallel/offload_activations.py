"""Activation offload (Megatron's fine-grained activation offloading, DeepSpeed's
``cpu_checkpointing``), applied to a model's blocks from outside, like recomputation: what a
block saves for backward goes to host memory during its forward and comes back ahead of its
backward. Device memory for host-device traffic, overlapped with compute.

How: the block's ``forward`` (replaced on the instance, so parameter names, module hooks and
checkpoints are unchanged) runs under ``torch.autograd.graph.saved_tensors_hooks``. Each tensor
autograd saves there is packed into a handle; its *storage* is copied once per block call (views
and tensors several nodes save share one copy) into a host buffer, pinned on CUDA, on a side
stream (:class:`hybridpar.distributed.device.CopyStream`); the device storage is kept only until
the block's forward returns, then freed (what else holds it, a pipeline runner's record or a
ZB-H1 deferred linear, keeps it alive as before). Not offloaded: parameters and views of them
(ZeRO-3's gathered ones included), the block's other tensor arguments (RoPE tables shared by
all blocks, document masks), tensors on another device than the run's (a CPU scalar in a CUDA run)
and non-strided tensors.

When the gradient of a block's output arrives (a tensor hook: the block's backward is about to
start) its storages are brought back, and so are those of the block that ran before it in the
same forward (its backward comes next), so one block's copy overlaps the other's backward on
CUDA; on CPU the same copies run synchronously. A fetched storage is freed once every handle of
it was freed by autograd. At most two blocks' saved bytes are back on the device at once (the planner's
working set, :mod:`hybridpar.planner.memory.offload`). Copies are exact: gradients are bitwise those
without offload.

Recomputation composes: wrapped outside :mod:`.recompute`'s checkpoint, what the checkpoint keeps
(the block's input) is what goes to host; its recomputation in backward runs without these hooks.
Which blocks: the first :func:`offloaded_count` of each pipeline chunk's (the earliest wait the
longest for their backward).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks

from hybridpar.distributed.device import CopyStream
from hybridpar.parallel.offload_count import offloaded_count

__all__ = ["ActivationOffload", "HostBytes", "offloaded_count"]


class _Resident:
    """A storage brought back to the device, alive while this holder is (tests count it)."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


class _Entry:
    """One saved storage of one block call: its host copy, how many handles still need it, and
    once fetched its device copy."""

    __slots__ = ("device", "event", "host", "pending", "source")

    def __init__(self, source: Tensor | None, host: Tensor) -> None:
        self.source, self.host, self.pending = source, host, 0
        self.device: _Resident | None = None
        self.event: object | None = None


class HostBytes:
    """Bytes the offload holds in host memory now, and the most it held (since :meth:`reset_peak`)."""

    def __init__(self) -> None:
        self.current = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def reset_peak(self) -> None:
        self.peak = self.current


class _Group:
    """The saved storages of one call of one block, and the group that ran before it."""

    def __init__(self, copies: CopyStream, skip: set[int], host: HostBytes) -> None:
        self.copies, self.skip, self.host = copies, skip, host
        self.entries: dict[int, _Entry] = {}
        self.prev: Callable[[], _Group | None] = lambda: None

    def pack(self, t: Tensor) -> Any:
        if t.layout != torch.strided or t.numel() == 0 or t.device != self.copies.device or _is_parameter(t):
            return _keep(t)
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip:
            return _keep(t)
        entry = self.entries.get(key)
        if entry is None:
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            entry = self.entries[key] = _Entry(raw, self.copies.host_buffer(storage.nbytes()))
            self.copies.to_host(raw, entry.host)
            self.host.add(storage.nbytes())
        entry.pending += 1
        return _Handle(self, key, t.dtype, t.shape, t.stride(), t.storage_offset())

    def close_forward(self) -> None:
        """The block's forward returned: drop the device storages (the copies keep what they read)."""
        for entry in self.entries.values():
            entry.source = None

    def fetch(self) -> None:
        """Start bringing every storage back (no-op for those already on their way)."""
        for entry in self.entries.values():
            if entry.device is None and entry.host is not None:
                tensor, entry.event = self.copies.to_device(entry.host)
                self.host.add(-entry.host.numel())
                entry.device, entry.host = _Resident(tensor), None

    def take(self, handle: _Handle) -> Tensor:
        entry = self.entries[handle.key]
        if entry.device is None:
            self.fetch()
        assert entry.device is not None
        raw = entry.device.tensor
        if entry.event is not None:
            self.copies.wait(raw, entry.event)
            entry.event = None
        return torch.empty(0, dtype=handle.dtype, device=raw.device).set_(
            raw.untyped_storage(), handle.offset, handle.shape, handle.stride)

    def release(self, key: int) -> None:
        """A handle of storage ``key`` is gone (autograd freed it): the last one frees the copies."""
        entry = self.entries[key]
        entry.pending -= 1
        if entry.pending == 0:
            if entry.host is not None:  # never brought back (no backward ran)
                self.host.add(-entry.host.numel())
            del self.entries[key]


class _Handle:
    """What autograd keeps for one saved tensor: its group, storage and view."""

    __slots__ = ("dtype", "group", "key", "offset", "shape", "stride")

    def __init__(self, group: _Group, key: int, dtype: torch.dtype, shape: torch.Size, stride: tuple[int, ...],
                 offset: int) -> None:
        self.group, self.key, self.dtype, self.shape = group, key, dtype, shape
        self.stride, self.offset = stride, offset

    def __del__(self) -> None:
        self.group.release(self.key)


def _keep(t: Tensor) -> Any:
    """What a tensor left on the device packs to: itself (tests swap this pair for counting ones,
    as the hooks of the blocks hide what they keep from any hooks around them)."""
    return t


def _kept(x: Any) -> Tensor:
    return x


def _unpack(x: Any) -> Tensor:
    return x.group.take(x) if isinstance(x, _Handle) else _kept(x)


def _is_parameter(t: Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(base, nn.Parameter)


def _storages(values: Iterable[Any]) -> set[int]:
    return {v.untyped_storage().data_ptr() for v in values if isinstance(v, Tensor)}


class ActivationOffload:
    """Offloads the saved tensors of the blocks given to :meth:`apply` (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.copies = CopyStream(device)
        self.blocks = 0  # blocks wrapped
        self.host = HostBytes()  # what is in host memory (training/features/activation_offload.py reports it)

    def apply(self, blocks: Iterable[nn.Module]) -> int:
        """Wrap each block's ``forward``; returns how many were wrapped (also in ``blocks``)."""
        for block in blocks:
            block.forward = functools.partial(self._offloaded, block.forward)  # type: ignore[method-assign]
            self.blocks += 1
        return self.blocks

    def _offloaded(self, forward: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(x, *args, **kwargs)
        group = _Group(self.copies, _storages((*args, *kwargs.values())), self.host)
        before = getattr(x, "_offload_group", None)
        if before is not None:
            group.prev = weakref.ref(before)
        try:
            with saved_tensors_hooks(group.pack, _unpack):
                out = forward(x, *args, **kwargs)
        finally:
            group.close_forward()
        if isinstance(out, Tensor) and out.requires_grad:
            out.register_hook(functools.partial(_arrived, weakref.ref(group)))
            out._offload_group = group  # type: ignore[attr-defined]  # the next block's predecessor
        return out


def _arrived(ref: Callable[[], _Group | None], grad: Tensor) -> None:
    """The block's output gradient arrived: bring its storages back, and its predecessor's."""
    group = ref()
    if group is not None:
        group.fetch()
        prev = group.prev()
        if prev is not None:
            prev.fetch()
