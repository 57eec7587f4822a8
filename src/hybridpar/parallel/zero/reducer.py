"""Data parallelism: gradients averaged over the dp axis in buckets, overlapped with backward.

Each parameter's ``.grad`` is a view into a flat bucket buffer (parameters taken in reverse
registration order, roughly the order backward produces them). A post-accumulate-grad hook
counts the parameters of a bucket as their gradients land; when the last one arrives on the
final micro-batch of a step, the bucket's all-reduce starts asynchronously while backward goes
on with earlier layers. Non-final micro-batches communicate nothing (:meth:`no_sync`).

Result: the same averaged gradient as one flat all-reduce after backward, i.e. the gradient of
the mean loss over the global batch, with 4 bytes x parameters (fp32) on the wire per step
(about 1 byte with int8 compression, which changes the result within its error feedback).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import nn

from hybridpar.distributed.comm import Pending
from hybridpar.distributed.compression import Int8AllReduce
from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.zero.sync import GradientSync


class _Bucket:
    def __init__(self, params: list[nn.Parameter], axis: Axis, int8: bool) -> None:
        self.params = params
        first = params[0]
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=first.dtype, device=first.device)
        self.ready = 0
        self.pending: Pending | None = None
        self.int8 = Int8AllReduce(axis, self.buffer.numel(), first.device) if int8 else None

    def start(self, axis: Axis) -> None:
        """Start this bucket's sum over ``axis`` (int8: its first, reduce-scatter phase)."""
        self.pending = (self.int8.start(self.buffer) if self.int8 is not None
                        else axis.comm.all_reduce_async(self.buffer, axis))


T = TypeVar("T")


def param_bytes(p: nn.Parameter) -> int:
    return p.numel() * p.element_size()


def cut_buckets(items: Iterable[T], nbytes: Callable[[T], int], bucket_bytes: int,
                compatible: Callable[[T, T], bool] = lambda first, item: True) -> list[list[T]]:
    """``items`` in reverse order (roughly the order backward produces their gradients), cut
    once a bucket holds ``bucket_bytes`` and wherever ``compatible(bucket's first, item)`` fails.
    The gradient reducer, ZeRO-1/2 and the planner's traffic model all bucket this way."""
    out: list[list[T]] = []
    cur: list[T] = []
    size = 0
    for item in reversed(list(items)):
        if cur and not compatible(cur[0], item):
            out.append(cur)
            cur, size = [], 0
        cur.append(item)
        size += nbytes(item)
        if size >= bucket_bytes:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


class GradientReducer(GradientSync):
    """Averages the gradients of ``params`` over ``axis`` (dp), bucket by bucket during backward.

    Call ``finish()`` after the last backward of a step (before clipping and the optimizer);
    wrap earlier micro-batches in ``no_sync()``. At ``axis.size == 1`` it installs nothing.
    ``int8``: each bucket is summed with int8 on the wire and error feedback
    (:class:`~hybridpar.distributed.compression.Int8AllReduce`; not with ``hierarchy``).
    """

    def __init__(self, params: list[nn.Parameter], axis: Axis, bucket_bytes: int,
                 hierarchy: tuple[Axis, Axis] | None = None, int8: bool = False) -> None:
        if int8 and hierarchy is not None:
            raise ValueError("int8 gradient compression and a hierarchical all-reduce do not combine; pick one")
        self.axis = axis
        # (intra-node, inter-node) split of ``axis``: buckets then reduce in three levels in
        # finish() (reduce-scatter in node, all-reduce across, all-gather in node), not overlapped
        self.hierarchy = hierarchy
        self.sync = True
        self.buckets: list[_Bucket] = []
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        if axis.size == 1:
            return
        self.buckets = [_Bucket(group, axis, int8) for group in cut_buckets(params, param_bytes, bucket_bytes)]
        for bucket in self.buckets:
            offset = 0
            for p in bucket.params:
                view = bucket.buffer[offset : offset + p.numel()].view_as(p)
                if p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view  # autograd accumulates into the bucket in place from now on
                offset += p.numel()
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(bucket)))

    def _hook(self, bucket: _Bucket):
        def on_grad(_: torch.Tensor) -> None:
            if not self.sync or self.hierarchy is not None:  # accumulate; finish() reduces
                return
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                bucket.start(self.axis)
        return on_grad

    def finish(self) -> None:
        """Wait for every bucket (starting any a hook did not, e.g. unused parameters) and
        divide by the dp size, so ``.grad`` holds the average over data-parallel ranks."""
        for bucket in self.buckets:
            if self.hierarchy is not None:
                self.axis.comm.hierarchical_all_reduce(bucket.buffer, *self.hierarchy)
            else:
                if bucket.pending is None:
                    bucket.start(self.axis)
                bucket.pending.wait()
                if bucket.int8 is not None:
                    bucket.int8.finish(bucket.buffer)
            bucket.buffer.div_(self.axis.size)
            bucket.pending = None
            bucket.ready = 0

    def residuals(self) -> list[torch.Tensor]:
        """int8 compression's error-feedback state, bucket by bucket (none without it)."""
        return [t for b in self.buckets if b.int8 is not None for t in b.int8.residuals()]

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
