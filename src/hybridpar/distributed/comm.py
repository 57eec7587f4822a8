"""Every collective and point-to-point call of the library, with traffic accounting.

This is the only module that calls ``torch.distributed`` communication functions. Each call is
issued on one :class:`~hybridpar.distributed.mesh.Axis` (a process group of the mesh) and recorded
in a per-rank :class:`CommCounter` as ``(op, axis name, payload bytes)``:

* payload bytes = ``numel * element_size`` of the tensor this rank contributes: the whole tensor
  for all-reduce, broadcast, send and recv; the local shard for all-gather; the full input for
  reduce-scatter; 0 for a barrier;
* wire bytes = what this rank sends under the bandwidth-optimal ring algorithms (NCCL's model),
  see :func:`wire_bytes`. This is the number to compare layouts with: ZeRO-3 (two all-gathers and
  one reduce-scatter) moves exactly 1.5x the wire bytes of one all-reduce.

Calls on a size-1 axis return at once and record nothing: a size-1 axis costs nothing.

The counter also keeps a flight recorder: the last 64 ops with a per-rank sequence number and
whether each completed, so a hang report can show where each rank stopped.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from hybridpar import compat
from hybridpar.distributed.staging import Host as _Host
from hybridpar.distributed.staging import is_gloo as _gloo

if TYPE_CHECKING:
    from hybridpar.distributed.mesh import Axis

ReduceName = Literal["sum", "avg", "max"]

# torch 2.13 renamed the flat-tensor collectives; older versions only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Op(enum.StrEnum):
    """The communication operations the counter knows."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"
    SEND = "send"
    RECV = "recv"
    BARRIER = "barrier"


def wire_bytes(op: Op | str, nbytes: int, group_size: int) -> int:
    """Bytes one rank sends for ``op`` with payload ``nbytes`` in a group of ``group_size``,
    under ring algorithms: all-reduce 2(n-1)/n B, all-gather (n-1) B (B = local shard),
    reduce-scatter (n-1)/n B (B = full input), broadcast/send B, recv and barrier 0. An
    all-to-all's wire bytes depend on its splits, not on ``nbytes`` alone: :meth:`Comm.all_to_all`
    records the bytes it sends to the other ranks (``(n-1)/n B`` for even splits).

    (Gloo implements reduce-scatter as all-reduce + slice, so on CPU it really moves twice
    this; the model counts what the algorithm needs, which is what NCCL sends.)
    """
    op, n = Op(op), group_size
    if n <= 1:
        return 0
    if op is Op.ALL_REDUCE:
        return 2 * (n - 1) * nbytes // n
    if op is Op.ALL_GATHER:
        return (n - 1) * nbytes
    if op is Op.REDUCE_SCATTER:
        return (n - 1) * nbytes // n
    if op in (Op.BROADCAST, Op.SEND):
        return nbytes
    if op is Op.ALL_TO_ALL:
        return (n - 1) * nbytes // n
    return 0


@dataclass(slots=True)
class OpRecord:
    """One entry of the flight recorder. ``done`` turns true when the call returned."""

    seq: int
    op: Op
    axis: str
    nbytes: int
    peer: int | None = None
    done: bool = False

    def __str__(self) -> str:
        peer = f" peer={self.peer}" if self.peer is not None else ""
        state = "done" if self.done else "IN FLIGHT"
        return f"#{self.seq} {self.op}/{self.axis}{peer} {self.nbytes} B {state}"


class CommCounter:
    """Per-rank traffic totals keyed by (op, axis), plus a ring of the most recent ops."""

    def __init__(self, history: int = 64) -> None:
        self._totals: dict[tuple[Op, str], list[int]] = {}  # -> [calls, bytes, wire bytes]
        self._recent: deque[OpRecord] = deque(maxlen=history)
        self._seq = 0

    def record(self, op: Op | str, axis: str, nbytes: int, *, peer: int | None = None,
               wire: int | None = None) -> OpRecord:
        """Count one call of ``op`` on ``axis`` moving ``nbytes`` of payload (``wire`` bytes on
        the wire, default ``nbytes``) and append it to the flight recorder."""
        op = Op(op)
        entry = self._totals.setdefault((op, axis), [0, 0, 0])
        entry[0] += 1
        entry[1] += nbytes
        entry[2] += nbytes if wire is None else wire
        rec = OpRecord(self._seq, op, axis, nbytes, peer)
        self._seq += 1
        self._recent.append(rec)
        return rec

    def reset(self) -> None:
        """Zero the traffic totals. The flight recorder and its sequence numbers keep running,
        so sequence numbers stay comparable across ranks in a hang report."""
        self._totals.clear()

    def _sum(self, column: int, op: Op | str | None, axis: str | None) -> int:
        want = None if op is None else Op(op)
        return sum(v[column] for (o, a), v in self._totals.items()
                   if (want is None or o is want) and (axis is None or a == axis))

    def calls(self, op: Op | str | None = None, axis: str | None = None) -> int:
        """Number of recorded calls, optionally only of one op and/or one axis."""
        return self._sum(0, op, axis)

    def bytes(self, op: Op | str | None = None, axis: str | None = None) -> int:
        """Payload bytes this rank contributed, optionally only of one op and/or one axis."""
        return self._sum(1, op, axis)

    def wire_bytes(self, op: Op | str | None = None, axis: str | None = None) -> int:
        """Bytes this rank sent under the ring model (see :func:`wire_bytes`)."""
        return self._sum(2, op, axis)

    def wire_bytes_by_axis(self) -> dict[str, int]:
        """``{axis: bytes this rank sent}`` (ring model) over every op, axes sorted."""
        out: dict[str, int] = {}
        for (_, axis), (_, _, wire) in sorted(self._totals.items(), key=lambda kv: kv[0][1]):
            out[axis] = out.get(axis, 0) + wire
        return out

    def wire_bytes_since(self, before: dict[str, int]) -> dict[str, int]:
        """Per-axis bytes sent since ``before`` (an earlier :meth:`wire_bytes_by_axis`), axes
        that sent nothing left out."""
        now = self.wire_bytes_by_axis()
        return {axis: sent - before.get(axis, 0) for axis, sent in now.items() if sent > before.get(axis, 0)}

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{"all_reduce/dp": {"calls": n, "bytes": b, "wire_bytes": w}, ...}``, sorted."""
        return {f"{op}/{axis}": {"calls": c, "bytes": b, "wire_bytes": w}
                for (op, axis), (c, b, w) in sorted(self._totals.items())}

    def recent(self) -> list[OpRecord]:
        """The flight recorder, oldest first (at most ``history`` entries)."""
        return list(self._recent)


class Pending:
    """Outstanding transfers (:meth:`Comm.batch_p2p`, :meth:`Comm.all_reduce_async`); ``wait()`` them."""

    def __init__(self, works: Sequence[dist.Work] = (), records: Sequence[OpRecord] = (),
                 then: Sequence[Callable[[], object]] = ()) -> None:
        self._works = list(works)
        self._records = list(records)
        self._then = list(then)  # run once, after the transfers completed

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        for rec in self._records:
            rec.done = True
        self._works.clear()
        for step in self._then:
            step()
        self._then.clear()

    def done(self) -> bool:
        """Whether every transfer has completed, without blocking (then as if waited)."""
        if all(compat.work_completed(work) for work in self._works):
            self.wait()
            return True
        return False


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _reduce_op(op: str, t: torch.Tensor) -> dist.ReduceOp:
    """The backend reduction for ``op``. ``avg`` is SUM followed by a division (gloo has no AVG;
    one code path keeps CPU and GPU results identical)."""
    if op == "max":
        return dist.ReduceOp.MAX
    if op in ("sum", "avg"):
        if op == "avg" and not (t.is_floating_point() or t.is_complex()):
            raise TypeError(f"op='avg' needs a floating-point tensor, got {t.dtype}")
        return dist.ReduceOp.SUM
    raise ValueError(f"unknown reduction op={op!r}; use 'sum', 'avg' or 'max'")


def _outside_graphs(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Collectives run outside compiled graphs (``train.compile``): a call is a graph break, never
    traced, so dynamo neither guards on the traffic counter nor reorders communication. Marked
    here and wrapped by ``torch.compiler.disable`` when the first :class:`Comm` is made (before
    anything can be compiled): applying it imports torch._dynamo, 3-4 s that a process which
    only imports this module (``hybridpar plan``) does not need to pay."""
    fn._hybridpar_outside_graphs = True  # type: ignore[attr-defined]
    return fn


class Comm:
    """Issues collectives and p2p on mesh axes and records their traffic in ``self.counter``."""

    _graph_breaks_applied = False

    def __init__(self, counter: CommCounter | None = None) -> None:
        self.counter = counter if counter is not None else CommCounter()
        if not Comm._graph_breaks_applied:
            Comm._graph_breaks_applied = True
            for name, fn in list(vars(Comm).items()):
                if getattr(fn, "_hybridpar_outside_graphs", False):
                    setattr(Comm, name, torch.compiler.disable(fn, recursive=True))

    def _record(self, op: Op, axis: Axis, nbytes: int, peer: int | None = None,
                wire: int | None = None) -> OpRecord:
        return self.counter.record(op, axis.name, nbytes, peer=peer,
                                   wire=wire_bytes(op, nbytes, axis.size) if wire is None else wire)

    @_outside_graphs
    def all_to_all(self, t: torch.Tensor, axis: Axis, send: Sequence[int], recv: Sequence[int]) -> torch.Tensor:
        """Rows ``t[sum(send[:r]) : sum(send[:r + 1])]`` go to local rank ``r``; returns the
        rows received, ``recv[s]`` of them from rank ``s``, in source order (variable splits:
        expert-parallel dispatch). Wire bytes: the rows sent to the other ranks."""
        if len(send) != axis.size or len(recv) != axis.size:
            raise ValueError(f"all_to_all on {axis.name} (size {axis.size}) needs one split per rank; "
                             f"got {len(send)} send and {len(recv)} receive splits")
        if axis.size == 1:
            return t
        row = math.prod(t.shape[1:]) * t.element_size()
        if t.shape[0] != sum(send):
            raise ValueError(f"all_to_all: {t.shape[0]} rows but the send splits add up to {sum(send)}")
        wire = row * sum(n for r, n in enumerate(send) if r != axis.rank)
        rec = self._record(Op.ALL_TO_ALL, axis, _nbytes(t), wire=wire)
        out = _Host(t.new_empty((sum(recv), *t.shape[1:])), axis.group, read=False)
        dist.all_to_all_single(out.host, _Host(t.contiguous(), axis.group).host, output_split_sizes=list(recv),
                               input_split_sizes=list(send), group=axis.group)
        rec.done = True
        return out.back()

    @_outside_graphs
    def all_reduce(self, t: torch.Tensor, axis: Axis, op: ReduceName = "sum") -> torch.Tensor:
        """In place: every rank of ``axis`` ends with the elementwise sum / mean / max of ``t``
        over the group. Returns ``t``."""
        if axis.size == 1:
            return t
        red = _reduce_op(op, t)
        rec = self._record(Op.ALL_REDUCE, axis, _nbytes(t))
        host = _Host(t, axis.group)
        dist.all_reduce(host.host, op=red, group=axis.group)
        host.back()
        if op == "avg":
            t.div_(axis.size)
        rec.done = True
        return t

    @_outside_graphs
    def all_reduce_async(self, t: torch.Tensor, axis: Axis) -> Pending:
        """Start an in-place sum of ``t`` over ``axis`` and return at once; ``wait()`` the result
        before reading ``t``. Lets gradient buckets reduce while backward keeps computing."""
        if axis.size == 1:
            return Pending()
        rec = self._record(Op.ALL_REDUCE, axis, _nbytes(t))
        host = _Host(t, axis.group)
        work = dist.all_reduce(host.host, op=dist.ReduceOp.SUM, group=axis.group, async_op=True)
        return Pending([work], [rec], then=host.then())

    @_outside_graphs
    def all_gather(self, t: torch.Tensor, axis: Axis, dim: int = 0) -> torch.Tensor:
        """The shards ``t`` of all ranks of ``axis``, concatenated along ``dim`` in local-rank
        order (same shape on every rank). Returns ``t`` itself on a size-1 axis."""
        if axis.size == 1:
            return t
        n, dim = axis.size, dim % t.dim()
        rec = self._record(Op.ALL_GATHER, axis, _nbytes(t))
        flat = _Host(t.new_empty((n * t.numel(),)), axis.group, read=False)
        _all_gather_flat(flat.host, _Host(t.contiguous().view(-1), axis.group).host, group=axis.group)
        out = flat.back().view(n, *t.shape)  # stacked in rank order; concatenate along dim
        out = out.movedim(0, dim).reshape(*t.shape[:dim], n * t.shape[dim], *t.shape[dim + 1:])
        rec.done = True
        return out

    @_outside_graphs
    def reduce_scatter(self, t: torch.Tensor, axis: Axis, dim: int = 0,
                       op: Literal["sum", "avg"] = "sum") -> torch.Tensor:
        """Reduce ``t`` (same shape on every rank) over ``axis`` and return this rank's chunk:
        ``reduce(t).chunk(axis.size, dim)[axis.rank]``. ``t.shape[dim]`` must divide evenly.
        Returns ``t`` itself on a size-1 axis."""
        if axis.size == 1:
            return t
        if op not in ("sum", "avg"):
            raise ValueError(f"reduce_scatter op={op!r}; use 'sum' or 'avg'")
        n, dim = axis.size, dim % t.dim()
        if t.shape[dim] % n:
            raise ValueError(f"reduce_scatter: size {t.shape[dim]} of dim {dim} is not divisible by "
                             f"{axis.name} size {n}; pad the tensor to a multiple of {n}")
        red = _reduce_op(op, t)
        rec = self._record(Op.REDUCE_SCATTER, axis, _nbytes(t))
        # Lay the n chunks out one after another in memory, so chunk k is contiguous block k.
        chunks = torch.stack(t.chunk(n, dim)) if dim else t.contiguous()
        out = _Host(t.new_empty(t.chunk(n, dim)[0].shape), axis.group, read=False)
        _reduce_scatter_flat(out.host.view(-1), _Host(chunks.view(-1), axis.group).host, op=red, group=axis.group)
        out = out.back()
        if op == "avg":
            out.div_(n)
        rec.done = True
        return out

    @_outside_graphs
    def hierarchical_all_reduce(self, t: torch.Tensor, intra: Axis, inter: Axis) -> torch.Tensor:
        """In place sum of ``t`` over ``intra`` x ``inter`` in three levels: reduce-scatter
        inside the node (``intra``), all-reduce of this rank's 1/intra share across nodes
        (``inter``), all-gather inside the node. Inter-node links carry 1/intra of what a flat
        all-reduce sends over them; each level is counted under its own axis name."""
        if intra.size == 1:
            return self.all_reduce(t, inter)
        flat = t.reshape(-1)
        n = intra.size
        padded = torch.cat([flat, flat.new_zeros((-flat.numel()) % n)]) if flat.numel() % n else flat
        share = self.reduce_scatter(padded, intra)
        self.all_reduce(share, inter)
        full = self.all_gather(share, intra)
        t.view(-1).copy_(full[: flat.numel()])
        return t

    @_outside_graphs
    def all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, axis: Axis, *,
                        async_op: bool = False) -> Pending:
        """Flat all-gather into a caller-owned buffer: ``out`` (``axis.size * shard.numel()``
        elements, contiguous) receives the shards of all ranks in local-rank order. With
        ``async_op`` the caller ``wait()``s before reading ``out`` (ZeRO-3 prefetch); ``shard``
        must not change until then. A size-1 axis copies and records nothing."""
        if out.numel() != axis.size * shard.numel():
            raise ValueError(f"all_gather_into: out has {out.numel()} elements, need "
                             f"{axis.size} x {shard.numel()}")
        return self._flat(Op.ALL_GATHER, out, shard, axis, async_op,
                          lambda o, i: _all_gather_flat(o, i, group=axis.group, async_op=True))

    @_outside_graphs
    def reduce_scatter_into(self, out: torch.Tensor, t: torch.Tensor, axis: Axis, *,
                            async_op: bool = False) -> Pending:
        """Flat reduce-scatter (sum) into a caller-owned buffer: ``out`` (``t.numel() /
        axis.size`` elements, contiguous) receives this rank's block of the sum of ``t`` over
        ``axis``. With ``async_op`` the caller ``wait()``s before reading ``out`` (ZeRO-2/3
        overlap with backward); ``t`` must stay alive until then, and on gloo it is overwritten
        (the sum runs in place there: :meth:`_reduce_scatter_by_all_reduce`). A size-1 axis
        copies and records nothing."""
        if t.numel() != axis.size * out.numel():
            raise ValueError(f"reduce_scatter_into: input has {t.numel()} elements, need "
                             f"{axis.size} x {out.numel()}")
        if axis.size > 1 and _gloo(axis.group) and t.is_contiguous():
            return self._reduce_scatter_by_all_reduce(out, t, axis, async_op)
        return self._flat(Op.REDUCE_SCATTER, out, t, axis, async_op,
                          lambda o, i: _reduce_scatter_flat(o, i, op=dist.ReduceOp.SUM, group=axis.group,
                                                            async_op=True))

    def _reduce_scatter_by_all_reduce(self, out: torch.Tensor, t: torch.Tensor, axis: Axis,
                                      async_op: bool) -> Pending:
        """gloo: the reduce-scatter as an in-place all-reduce of ``t`` (overwritten) and a copy of
        this rank's block. gloo's own reduce-scatter is the slower of the two at every size
        measured (2 ranks, medians of 200 interleaved calls: 0.54 vs 0.46 ms at 64K floats,
        1.19 vs 0.84 ms at 180K, 4.7 vs 3.6 ms at 1M). Recorded as the reduce-scatter it is:
        the counter's bytes and wire bytes are the collective's under NCCL's model, which is
        what the planner prices. With two ranks the sum is bitwise the same either way."""
        rec = self._record(Op.REDUCE_SCATTER, axis, _nbytes(t))
        flat, k = _Host(t.view(-1), axis.group).host, out.numel()
        mine = flat[axis.rank * k:(axis.rank + 1) * k]
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=axis.group, async_op=True)
        pending = Pending([work], [rec], then=[lambda: out.view(-1).copy_(mine)])
        if not async_op:
            pending.wait()
        return pending

    def _flat(self, op: Op, out: torch.Tensor, t: torch.Tensor, axis: Axis, async_op: bool,
              launch: Callable[[torch.Tensor, torch.Tensor], dist.Work]) -> Pending:
        """The ``*_into`` collectives: on a size-1 axis ``t`` is copied to ``out`` and nothing is
        recorded; else ``launch(flat out, flat t)`` is counted with ``t`` as the payload."""
        if axis.size == 1:
            out.view(-1).copy_(t.reshape(-1))
            return Pending()
        rec = self._record(op, axis, _nbytes(t))
        dst = _Host(out.view(-1), axis.group, read=False)
        pending = Pending([launch(dst.host, _Host(t.contiguous().view(-1), axis.group).host)], [rec], then=dst.then())
        if not async_op:
            pending.wait()
        return pending

    @_outside_graphs
    def broadcast(self, t: torch.Tensor, axis: Axis, src: int) -> torch.Tensor:
        """In place: every rank of ``axis`` gets the ``t`` of local rank ``src``. Returns ``t``."""
        if axis.size == 1:
            return t
        rec = self._record(Op.BROADCAST, axis, _nbytes(t), peer=axis.global_rank(src))
        host = _Host(t, axis.group)
        dist.broadcast(host.host, src=axis.global_rank(src), group=axis.group)
        rec.done = True
        return host.back()

    def _check_peer(self, peer: int, axis: Axis) -> None:
        if peer not in axis.ranks or peer == axis.global_rank(axis.rank):
            raise ValueError(f"peer {peer} is not another rank of the {axis.name} group {list(axis.ranks)}")

    @_outside_graphs
    def send(self, t: torch.Tensor, peer: int, axis: Axis) -> None:
        """Blocking send of ``t`` to global rank ``peer`` (a rank of this ``axis`` group)."""
        if axis.size == 1:
            return
        self._check_peer(peer, axis)
        rec = self._record(Op.SEND, axis, _nbytes(t), peer=peer)
        dist.send(_Host(t.contiguous(), axis.group).host, dst=peer, group=axis.group)
        rec.done = True

    @_outside_graphs
    def recv(self, t: torch.Tensor, peer: int, axis: Axis) -> torch.Tensor:
        """Blocking receive into contiguous ``t`` from global rank ``peer``. Returns ``t``."""
        if axis.size == 1:
            return t
        self._check_peer(peer, axis)
        if not t.is_contiguous():
            raise ValueError("recv needs a contiguous buffer")
        rec = self._record(Op.RECV, axis, _nbytes(t), peer=peer)
        host = _Host(t, axis.group, read=False)
        dist.recv(host.host, src=peer, group=axis.group)
        rec.done = True
        return host.back()

    @_outside_graphs
    def batch_p2p(self, ops: Sequence[tuple[Literal["send", "recv"], torch.Tensor, int]],
                  axis: Axis, *, wait: bool = True) -> Pending:
        """Post all ``(kind, tensor, peer global rank)`` sends and receives at once (no ordering
        deadlocks, e.g. a ring exchange). With ``wait=False`` the caller waits on the result.
        A single transfer is posted as a plain ``isend``/``irecv`` (what a batch of one amounts to,
        and what torch.distributed.pipelining posts), without the batch API's checks per call."""
        if axis.size == 1 or not ops:
            return Pending()
        posted = [self._p2p_op(kind, t, peer, axis) for kind, t, peer in ops]
        records = [rec for _, _, _, rec, _ in posted]
        if len(posted) == 1:
            fn, t, peer, _, _ = posted[0]
            works = [fn(t, peer, group=axis.group)]
        else:
            works = dist.batch_isend_irecv([dist.P2POp(fn, t, peer=peer, group=axis.group)
                                            for fn, t, peer, _, _ in posted])
        pending = Pending(works, records, then=[back for *_, host in posted for back in host.then()])
        if wait:
            pending.wait()
        return pending

    def _p2p_op(self, kind: str, t: torch.Tensor, peer: int, axis: Axis
                ) -> tuple[Callable[..., Any], torch.Tensor, int, OpRecord, _Host]:
        """One transfer of :meth:`batch_p2p`, checked and counted: (isend or irecv, the tensor
        to post, the peer, its record, the tensor's host staging)."""
        self._check_peer(peer, axis)
        if kind == "send":
            fn, op = dist.isend, Op.SEND
            t = t.contiguous()
        elif kind == "recv":
            fn, op = dist.irecv, Op.RECV
            if not t.is_contiguous():
                raise ValueError("recv needs a contiguous buffer")
        else:
            raise ValueError(f"batch_p2p kind {kind!r}; use 'send' or 'recv'")
        host = _Host(t, axis.group, read=kind == "send")
        return fn, host.host, peer, self._record(op, axis, _nbytes(t), peer=peer), host

    @_outside_graphs
    def barrier(self, axis: Axis | None = None) -> None:
        """Wait until every rank of ``axis`` (all ranks when None) gets here."""
        if axis is None:
            if not dist.is_initialized() or dist.get_world_size() == 1:
                return
            rec = self.counter.record(Op.BARRIER, "world", 0)
            dist.barrier()
        else:
            if axis.size == 1:
                return
            rec = self._record(Op.BARRIER, axis, 0)
            dist.barrier(group=axis.group)
        rec.done = True
