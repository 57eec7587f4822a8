"""Pipeline makespans for the planner: the schedule simulator's arithmetic on compiled schedules,
and a closed-form lower bound that lets the search skip most simulations.

:func:`makespan` computes exactly what :func:`hybridpar.parallel.pipeline.simulate.simulate`
computes (the same start and end times, in the same floating-point order: each compute starts at
``max(its rank's clock, max(sent, posted) + p2p)`` of the message it needs), from the action
lists :func:`~hybridpar.parallel.pipeline.schedules.build_schedule` makes, but compiled once per
``(schedule, pp, V, M)`` into integer ops: no ``Message`` objects hashed per action, no intervals
kept. ``tests/test_planner_validation.py`` checks it equals ``simulate(...).makespan``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from hybridpar.parallel.pipeline.schedules import (
    ActionKind,
    Schedule,
    build_schedule,
    compute_order,
    rank_stages,
)

_F, _B, _W, _SEND, _RECV = range(5)


@dataclass(frozen=True)
class CompiledSchedule:
    """Per rank, ops ``(code, stage, message id)``: compute F/B/W of ``stage`` needing message
    ``id`` (-1: none), or the send / receive-post of message ``id``."""

    kind: str
    pp: int
    stages: int
    split_backward: bool
    messages: int
    ops: tuple[tuple[tuple[int, int, int], ...], ...]


@functools.lru_cache(maxsize=256)
def compile_schedule(kind: str, pp: int, virtual_stages: int, microbatches: int) -> CompiledSchedule:
    """:func:`build_schedule`'s action lists as integer ops (cached: schedules are pure data).
    A message is numbered by what identifies it, ``(micro-batch, destination stage, payload)``,
    as :meth:`Action.message` and :func:`needed_message` define it."""
    sched = build_schedule(kind, pp, virtual_stages, microbatches)
    n = sched.num_stages

    def mid(mb: int, dst: int, grad: int) -> int:
        # a hand-over between two stages of one rank (ZBV's turn) waits for nothing: its producer
        # ran earlier on the same rank (check_schedule), as simulate's max(clock, ready) finds
        src = dst - 1 if not grad else dst + 1
        return -1 if sched.rank_of(src) == sched.rank_of(dst) else (mb * n + dst) * 2 + grad

    ops = []
    for acts in sched.ranks:
        row = []
        for a in acts:
            k, mb, s = a.kind, a.microbatch, a.stage
            if k is ActionKind.F:
                row.append((_F, s, mid(mb, s, 0) if s > 0 else -1))
            elif k is ActionKind.B:
                row.append((_B, s, mid(mb, s, 1) if s < n - 1 else -1))
            elif k is ActionKind.W:
                row.append((_W, s, -1))
            else:
                row.append(_COMM[k](mb, s, mid))
        ops.append(tuple(row))
    ids = 1 + max(a.microbatch for acts in sched.ranks for a in acts)  # 2BW's steady step: the next batch's too
    return CompiledSchedule(sched.kind.value, pp, n, sched.split_backward, 2 * n * ids, tuple(ops))


_COMM = {  # send/recv action -> op; the message's destination stage and payload as Action.message
    ActionKind.SEND_ACT: lambda mb, s, mid: (_SEND, s, mid(mb, s + 1, 0)),
    ActionKind.RECV_ACT: lambda mb, s, mid: (_RECV, s, mid(mb, s, 0)),
    ActionKind.SEND_GRAD: lambda mb, s, mid: (_SEND, s, mid(mb, s - 1, 1)),
    ActionKind.RECV_GRAD: lambda mb, s, mid: (_RECV, s, mid(mb, s, 1)),
}


def makespan(c: CompiledSchedule, f: float, b: float, w: float, p2p: float,
             scale: tuple[float, ...] = ()) -> float:
    """``simulate(schedule, Costs(f, b, w, p2p, scale).per_chunk(V)).makespan``: ``f, b, w`` are
    per-stage costs, each chunk costs ``1/V`` of them times its stage's ``scale``."""
    v = float(c.stages // c.pp)
    fv, bv, wv = f / v, b / v, w / v
    full = bv if c.split_backward else bv + wv
    if scale:
        cost = [[fv * s for s in scale], [full * s for s in scale], [wv * s for s in scale]]
    else:
        cost = [[fv] * c.stages, [full] * c.stages, [wv] * c.stages]
    sent = [-1.0] * c.messages
    posted = [-1.0] * c.messages
    pc = [0] * c.pp
    clock = [0.0] * c.pp
    while True:
        moved = False
        for r, ops in enumerate(c.ops):
            i, t = pc[r], clock[r]
            while i < len(ops):
                code, stage, msg = ops[i]
                if code == _SEND:
                    sent[msg] = t
                elif code == _RECV:
                    posted[msg] = t
                else:
                    start = t
                    if msg >= 0:
                        if sent[msg] < 0:
                            break
                        if posted[msg] < 0:
                            raise RuntimeError(f"rank {r}: a compute runs before its receive is posted")
                        start = max(start, max(sent[msg], posted[msg]) + p2p)
                    t = start + cost[code][stage]
                i += 1
                moved = True
            pc[r], clock[r] = i, t
        if all(pc[r] == len(ops) for r, ops in enumerate(c.ops)):
            return max(clock, default=0.0)
        if not moved:
            raise RuntimeError(f"{c.kind} pp={c.pp} deadlocks")


@functools.lru_cache(maxsize=8192)
def deferred_weights(kind: str, pp: int, virtual_stages: int, microbatches: int,
                     rank: int) -> tuple[int, ...]:
    """Per local chunk, the W actions rank ``rank`` runs after its last B (ZB-H1 defers them;
    the tail is the same for any ``M >= 2 pp``, so longer runs are read off ``2 pp``)."""
    out = [0] * virtual_stages
    m = min(microbatches, 2 * pp)
    stages = rank_stages(rank, pp, virtual_stages, Schedule.parse(kind) is Schedule.ZBV)
    for a in reversed(compute_order(kind, pp, virtual_stages, m, rank)):
        if a.kind is ActionKind.B:
            break
        if a.kind is ActionKind.W:
            out[stages.index(a.stage)] += 1
    return tuple(out)


def lower_bound(kind: str, pp: int, v: int, m: int, f: float, b: float, w: float, p2p: float,
                scale: tuple[float, ...]) -> float:
    """A lower bound of the makespan of ``m`` micro-batches (any ``m``; closed form, no
    simulation). Rank ``r`` starts only after micro-batch 0 went through stages ``0..r-1``
    (their forwards and a p2p each), then works ``busy_r``; its last B (micro-batch M-1 on its
    first chunk, followed only by deferred Ws) still has to travel back through the backwards of
    stages ``r-1..0``. Extrapolating a simulation of fewer micro-batches at the bottleneck rate
    never goes below it either."""
    split = Schedule.parse(kind) in (Schedule.ZB_H1, Schedule.ZBV)
    v_shape = Schedule.parse(kind) is Schedule.ZBV
    back = b if split else b + w
    unit = (f + b + w) / v
    best = head = tail = 0.0
    for r in range(pp):
        mine = rank_stages(r, pp, v, v_shape)
        busy = m * unit * sum(scale[s] for s in mine)
        after = sum(n * w / v * scale[s]
                    for s, n in zip(mine, deferred_weights(kind, pp, v, m, r), strict=True)) if split else 0.0
        best = max(best, head + busy, head + busy + tail - after)
        head += f / v * scale[r] + p2p
        tail += back / v * scale[r] + p2p
    return best
