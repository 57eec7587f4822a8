"""The one shard layout every ZeRO stage uses, and the gradient reduce-scatter built on it.

Every parameter is split along dim 0 into ``n`` row blocks with ``torch.chunk`` semantics: rank
``r`` owns rows ``[r*s, min((r+1)*s, d0))`` with ``s = ceil(d0 / n)`` (the last ranks may own
fewer rows, or none). That is exactly a ``DTensor`` with placement ``Shard(0)`` over the dp
mesh, so optimizer state and ZeRO-3 parameters save through ``torch.distributed.checkpoint`` as
ordinary sharded tensors that reload at any other dp size or ZeRO stage.

A *group* of parameters (a ZeRO-1/2 bucket or a ZeRO-3 unit) is packed rank-major into one flat
buffer of ``n * S`` elements: block ``r`` holds rank ``r``'s rows of every parameter, each padded
to ``s`` rows. A reduce-scatter of that buffer leaves on each rank exactly its own rows (``S``
elements), and an all-gather of each rank's ``S`` elements rebuilds it. Padding is zero and
never visible through the per-parameter views.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridpar.compat import storage_ptr_nbytes
from hybridpar.distributed.comm import Pending
from hybridpar.distributed.compression import Int8ReduceScatter
from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.zero.replicate import Replicas, ReplicaSum, replica_sum


class ShardLayout:
    """Offsets of a group of parameter shapes split ``n`` ways along dim 0, seen by ``rank``."""

    def __init__(self, shapes: Sequence[torch.Size | tuple[int, ...]], n: int, rank: int) -> None:
        self.shapes = [torch.Size(s) for s in shapes]
        for shape in self.shapes:
            if len(shape) == 0:
                raise ValueError("ZeRO shards parameters along dim 0; a 0-d parameter has none "
                                 "(reshape it to (1,))")
        self.n, self.rank = n, rank
        self.rows = [s[0] for s in self.shapes]
        self.row_numel = [math.prod(s[1:]) for s in self.shapes]
        self.shard_rows = [-(-d0 // n) for d0 in self.rows]  # ceil
        self.shard_numel = [s * r for s, r in zip(self.shard_rows, self.row_numel, strict=True)]
        self.offsets: list[int] = []
        total = 0
        for k in self.shard_numel:
            self.offsets.append(total)
            total += k
        self.size = total  # S: this rank's flat shard, padded; the group's packed buffer is n * S
        # Fixed for the layout's life, read every step: this rank's rows, shapes and the split of
        # its flat shard into (parameter, padding) pieces, so views() is one split, not a loop.
        self._own_rows = [self._rows_of(i, rank) for i in range(len(self.shapes))]
        self._own_shapes = [torch.Size((hi - lo, *shape[1:])) for (lo, hi), shape in zip(self._own_rows, self.shapes, strict=True)]
        numels = [math.prod(s) for s in self._own_shapes]
        self._pieces = [k for n_i, full in zip(numels, self.shard_numel, strict=True) for k in (n_i, full - n_i)]
        self._whole = [d0 // s if s else 0 for d0, s in zip(self.rows, self.shard_rows, strict=True)]  # ranks with s rows

    def __len__(self) -> int:
        return len(self.shapes)

    def _rows_of(self, i: int, r: int) -> tuple[int, int]:
        d0, s = self.rows[i], self.shard_rows[i]
        return min(r * s, d0), min((r + 1) * s, d0)

    def local_rows(self, i: int, rank: int | None = None) -> tuple[int, int]:
        """Row range ``[lo, hi)`` of parameter ``i`` owned by ``rank`` (default: this rank)."""
        return self._own_rows[i] if rank is None else self._rows_of(i, rank)

    def local_shape(self, i: int) -> torch.Size:
        return self._own_shapes[i]

    def local_numel(self) -> int:
        """Elements this rank owns (unpadded) over the group."""
        return sum(math.prod(self.local_shape(i)) for i in range(len(self)))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """This rank's (unpadded) rows of every parameter as views into its flat shard ``flat``."""
        pieces = flat[: self.size].split(self._pieces)
        return [piece.view(shape) for piece, shape in zip(pieces[::2], self._own_shapes, strict=True)]

    def pack(self, out: torch.Tensor, i: int, full: torch.Tensor | None) -> None:
        """Write full tensor ``i`` (None: zeros) into its columns of the rank-major buffer ``out``
        (``n * S`` elements), casting to ``out``'s dtype and zero-padding."""
        region = out.view(self.n, self.size)[:, self.offsets[i] : self.offsets[i] + self.shard_numel[i]]
        if full is None:
            region.zero_()
            return
        flat, k, whole = full.reshape(-1), self.shard_numel[i], self._whole[i]
        if whole:
            region[:whole].copy_(flat[: whole * k].view(whole, k))
        if whole < self.n:
            rest = flat[whole * k :]
            region[whole, : rest.numel()].copy_(rest)
            region[whole, rest.numel() :].zero_()
            region[whole + 1 :].zero_()

    def unpack(self, src: torch.Tensor, i: int, full: torch.Tensor) -> None:
        """Inverse of :meth:`pack`: fill full tensor ``i`` from the rank-major buffer ``src``."""
        region = src.view(self.n, self.size)[:, self.offsets[i] : self.offsets[i] + self.shard_numel[i]]
        flat, k, whole = full.view(-1), self.shard_numel[i], self._whole[i]
        if whole:
            flat[: whole * k].view(whole, k).copy_(region[:whole])
        if whole < self.n:
            rest = flat[whole * k :]
            rest.copy_(region[whole, : rest.numel()])


@dataclass(frozen=True)
class OuterSplit:
    """The tensors ZeRO shards are themselves pieces of larger ones: tensor parallelism split
    parameter ``name`` along ``dim_of(name)`` over ``axis`` (None: replicated over it).
    ``inner``: a further split of those pieces (expert parallelism's experts over ep, then tp)."""

    axis: Axis
    dim_of: Callable[[str], int | None]
    inner: OuterSplit | None = None

    def chain(self) -> list[OuterSplit]:
        """This split and every inner one, outermost first."""
        return [self, *(self.inner.chain() if self.inner is not None else [])]


class ShardMesh:
    """``DTensor`` views of ZeRO shards for ``torch.distributed.checkpoint``: ``Shard(0)`` over
    the ZeRO axis and, with an :class:`OuterSplit`, nested inside the tensor-parallel split on a
    2-D mesh ``(tp, zero)``. DTensor splits in mesh-dim order, so ``[Shard(0), Shard(0)]`` is
    "tp's rows, then ZeRO's rows of those": exactly how the shards were made. Any other layout
    then reads the pieces it needs."""

    def __init__(self, axis: Axis | None, outer: OuterSplit | None, device_type: str) -> None:
        self.axis = axis if axis is not None and axis.size > 1 else None  # None: not ZeRO-sharded
        self.device_type = device_type
        self.outers = [o for o in (outer.chain() if outer is not None else []) if o.axis.size > 1]
        self.outer = self.outers[0] if len(self.outers) == 1 else None
        self._mesh: Any = None

    @property
    def active(self) -> bool:
        """Whether any tensor here is a piece of a larger one."""
        return self.axis is not None or bool(self.outers)

    def mesh(self) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        if self._mesh is None and len(self.outers) > 1:  # ranks are linear in every coordinate
            axes = [o.axis for o in self.outers] + ([self.axis] if self.axis is not None else [])
            me = axes[0].ranks[axes[0].rank]
            grid = torch.tensor(me)
            for a in axes:
                grid = grid.unsqueeze(-1) + (torch.tensor(a.ranks) - me)
            self._mesh = DeviceMesh.from_group([a.group for a in axes], self.device_type, mesh=grid.to(torch.int),
                                               mesh_dim_names=tuple(f"{a.name}{i}" for i, a in enumerate(axes)))
        if self._mesh is None:
            if self.outer is None:
                self._mesh = DeviceMesh.from_group(self.axis.group, self.device_type)
            elif self.axis is None:
                self._mesh = DeviceMesh.from_group(self.outer.axis.group, self.device_type)
            else:  # ranks are linear in the mesh coordinates: rank(i, j) = tp_i + zero_j - me
                tp, me = self.outer.axis, self.axis.ranks[self.axis.rank]
                ranks = [[t + z - me for z in self.axis.ranks] for t in tp.ranks]
                self._mesh = DeviceMesh.from_group([tp.group, self.axis.group], self.device_type,
                                                   mesh=torch.tensor(ranks, dtype=torch.int),
                                                   mesh_dim_names=("tp", "zero"))
        return self._mesh

    def dtensor(self, local: torch.Tensor, name: str, shape: torch.Size) -> Any:
        """This rank's piece ``local`` of parameter ``name`` (or of its optimizer state), whose
        tensor-parallel part has ``shape``, as a DTensor of the full tensor."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        placements: list[Any] = []
        full = list(shape)
        for outer in self.outers:
            dim = outer.dim_of(name)
            placements.append(Replicate() if dim is None else Shard(dim))
            if dim is not None:
                full[dim] *= outer.axis.size
        if self.axis is not None:
            placements.append(Shard(0))
        stride = torch.empty(full, device="meta").stride()
        return DTensor.from_local(local, self.mesh(), placements, run_check=False,
                                  shape=torch.Size(full), stride=stride)


def storage_bytes(tensors: Sequence[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the distinct storages behind ``tensors`` not already in ``seen`` (updated)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        ptr, nbytes = storage_ptr_nbytes(t)
        if nbytes == 0 or ptr in seen:
            continue
        seen.add(ptr)
        total += nbytes
    return total


class GradShard:
    """Reduce-scatters the full ``.grad`` of a group of parameters into this rank's shard.

    ``on_grad(i)`` (from a post-accumulate-grad hook, outside ``no_sync``) packs parameter
    ``i``'s gradient into a transient rank-major buffer; when every parameter of the group has
    arrived the reduce-scatter starts asynchronously, so it overlaps the rest of backward.
    ``finish()`` waits and leaves the average over ranks in :attr:`flat` (``S`` elements, param
    dtype) or, with ``keep_full`` (ZeRO-1), in this rank's rows of each parameter's own
    ``.grad``. Full gradients are dropped as soon as they are packed unless ``keep_full``.

    Gradients accumulate across backward passes until :meth:`zero`: extra passes outside
    ``no_sync`` reduce again and add (ZeRO-2/3); ZeRO-1 refuses a second one, since its full
    buffer already holds reduced rows. With ``reduce_dtype`` bf16/fp16 the payload is cast and
    pre-divided by ``n`` before the sum, then cast back; with ``torch.int8`` it is quantised
    block-wise with error feedback and summed in fp32 after the transfer
    (:class:`~hybridpar.distributed.compression.Int8ReduceScatter`).

    With ``replicas`` (hybrid sharding, :mod:`hybridpar.parallel.zero.replicate`) the reduced
    shard is then summed over the groups holding the same shard, and the average is over all of
    them (``n x replicas`` ranks).
    """

    def __init__(self, layout: ShardLayout, params: Sequence[nn.Parameter], axis: Axis, *,
                 keep_full: bool = False, reduce_dtype: torch.dtype | None = None,
                 replicas: Replicas | None = None) -> None:
        self.layout, self.params, self.axis = layout, list(params), axis
        self.keep_full = keep_full
        first = self.params[0]
        self.dtype, self.device = first.dtype, first.device
        self.int8: Int8ReduceScatter | None = None
        self.reduce_dtype = first.dtype
        self.replicas: Replicas | None = None
        self._across: ReplicaSum | None = None
        self.compress(reduce_dtype)
        self.replicate(replicas)
        self.trainable = {i for i, p in enumerate(self.params) if p.requires_grad}
        self.flat: torch.Tensor | None = None  # reduced shard (not keep_full); None after zero()
        self._staging: torch.Tensor | None = None
        self._packed: set[int] = set()
        self._out: torch.Tensor | None = None
        self._pending: Pending | None = None
        self.dirty = False  # a gradient arrived that is not reduced yet
        self.reduced = False  # keep_full: this step's reduction already happened

    def compress(self, reduce_dtype: torch.dtype | None) -> None:
        """Set the reduction's payload type: None (the parameter dtype), bf16/fp16, or int8
        (staged in the parameter dtype, quantised on the way out, with error feedback)."""
        self.int8 = Int8ReduceScatter(self.axis, self.layout.size, self.device) if reduce_dtype == torch.int8 else None
        self.reduce_dtype = self.dtype if self.int8 is not None else reduce_dtype or self.dtype
        self.replicate(self.replicas)

    def replicate(self, replicas: Replicas | None) -> None:
        """Sum the reduced shard over ``replicas`` too (HSDP; None: the group is all of dp),
        int8 across them when the reduce-scatter is int8."""
        self.replicas = replicas
        self._across = replica_sum(replicas, self.layout.size, self.device, self.int8 is not None)

    @property
    def ranks(self) -> int:
        """How many ranks' gradients the reduced shard sums: the group's times its replicas'."""
        return self.layout.n * (self._across.replicas.size if self._across is not None else 1)

    def note_grad(self) -> None:
        """A backward produced gradients for this group (in or out of ``no_sync``)."""
        if self.keep_full and self.reduced:
            raise RuntimeError("ZeRO-1 keeps one full gradient buffer whose own rows already hold the "
                               "reduced gradient: run every backward but the last of a step inside "
                               "no_sync(), then step(), then zero_grad()")
        self.dirty = True

    def on_grad(self, i: int) -> None:
        """Parameter ``i``'s gradient is complete for this pass: pack it; launch when all are."""
        if i in self._packed and self.keep_full and self._pending is None:
            pass  # ZeRO-1: .grad accumulated in place, so packing again is right
        elif self._pending is not None or i in self._packed:  # a new pass: reduce the last one first
            self.finish()
            self.dirty = True
        self._pack(i)
        if self.trainable <= self._packed:
            self.launch()

    def _pack(self, i: int) -> None:
        if self._staging is None:
            self._staging = torch.empty(self.layout.n * self.layout.size, dtype=self.reduce_dtype,
                                        device=self.device)
        p = self.params[i]
        self.layout.pack(self._staging, i, p.grad)
        self._packed.add(i)
        if not self.keep_full:
            p.grad = None

    @property
    def in_flight(self) -> bool:
        """Whether a reduce-scatter was started and not finished."""
        return self._pending is not None

    def launch(self) -> None:
        """Pack whatever has not arrived (unused parameters count as zero) and start the sum."""
        if self._pending is not None:
            return
        for i in range(len(self.params)):
            if i not in self._packed:
                self._pack(i)
        if self.int8 is not None:
            self._pending = self.int8.start(self._staging)
            return
        compressed = self.reduce_dtype != self.dtype
        if compressed:
            self._staging.div_(self.ranks)  # pre-divide: a low-precision sum must not overflow
        if self.flat is None and not compressed and not self.keep_full:
            self.flat = torch.empty(self.layout.size, dtype=self.dtype, device=self.device)
            self._out = self.flat  # first reduction of the step lands in place
        else:
            self._out = torch.empty(self.layout.size, dtype=self.reduce_dtype, device=self.device)
        self._pending = self.axis.comm.reduce_scatter_into(self._out, self._staging, self.axis, async_op=True)

    def finish(self) -> None:
        """Reduce anything not reduced yet, wait, and leave the averaged shard in place."""
        if self._pending is None:
            if not (self.dirty or self._packed):
                return
            self.launch()
        self._pending.wait()
        out = self._out if self.int8 is None else self.int8.result()  # int8: a new fp32 sum
        self._pending, self._staging = None, None
        self._out, self._packed, self.dirty = None, set(), False
        if self._across is not None:
            self._across(out)
        if self.reduce_dtype == self.dtype:
            out.div_(self.ranks)
        if self.keep_full:
            for i, (p, view) in enumerate(zip(self.params, self.layout.views(out), strict=True)):
                lo, hi = self.layout.local_rows(i)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad[lo:hi].copy_(view)
            self.reduced = True
        elif out is not self.flat:
            if self.flat is None:
                self.flat = out.to(self.dtype)
            else:
                self.flat.add_(out.to(self.dtype))

    def views(self) -> list[torch.Tensor | None]:
        """This rank's reduced gradient rows of each parameter (None before any reduction)."""
        if self.keep_full:
            return [None if p.grad is None else p.grad[slice(*self.layout.local_rows(i))]
                    for i, p in enumerate(self.params)]
        if self.flat is None:
            return [None] * len(self.params)
        return self.layout.views(self.flat)

    def zero(self) -> None:
        """Forget this step's gradients (like ``zero_grad``); waits for a reduction in flight."""
        if self._pending is not None:
            self._pending.wait()
        self._pending = self._staging = self._out = None
        self._packed, self.dirty, self.reduced = set(), False, False
        self.flat = None
        for p in self.params:
            if self.keep_full and p.grad is not None:
                p.grad.zero_()
            elif not self.keep_full:
                p.grad = None

    def residuals(self) -> list[torch.Tensor]:
        """int8 compression's error-feedback state (none without it)."""
        own = self.int8.residuals() if self.int8 is not None else []
        return own + (self._across.residuals() if self._across is not None else [])

    def held_tensors(self) -> list[torch.Tensor | None]:
        """Gradient tensors this group keeps alive (for memory accounting)."""
        full = [p.grad for p in self.params]
        return [self.flat, *full, self._staging, self._out]
