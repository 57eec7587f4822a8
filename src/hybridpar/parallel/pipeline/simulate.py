"""Time a schedule's action lists under per-action costs: makespan, busy/idle intervals, bubble.

The simulator executes exactly the semantics the runtime implements (see
:mod:`.schedules`): a send is posted when its rank reaches it and never blocks; a receive is
posted when its rank reaches it; its data is ready ``p2p`` after both the send and the receive are
posted (a local message, between two stages of one rank as in ZBV, is ready when its producer
ends); a compute action starts when its rank is free and its received input is ready. If no rank
can move while some are unfinished, the lists deadlock and :class:`DeadlockError` names what each
blocked rank waits for, so the same function is the deadlock check of the tests.

Costs are per action, i.e. per chunk (an interleaved chunk is 1/V of a stage: use
:meth:`Costs.per_chunk`). The planner reuses :func:`simulate` with its own cost estimates.
:func:`check_schedule` holds the structural checks of an action list (counts, order, matching).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from hybridpar.parallel.pipeline.schedules import (
    Action,
    ActionKind,
    Message,
    Payload,
    PipelineSchedule,
    Schedule,
    ScheduleError,
    needed_message,
    produced_message,
)


class DeadlockError(RuntimeError):
    """The action lists cannot all finish: some rank waits for a message never sent in time."""


@dataclass(frozen=True)
class Costs:
    """Seconds (or any unit) per action: forward ``f``, input-gradient backward ``b``, weight
    gradient ``w``, one p2p transfer ``p2p``. A full backward (non-split schedules) costs
    ``b + w``. ``stage_scale[s]`` multiplies the compute costs of stage ``s`` (imbalanced
    partitions); empty means 1 everywhere."""

    f: float = 1.0
    b: float = 1.0
    w: float = 1.0
    p2p: float = 0.0
    stage_scale: tuple[float, ...] = ()

    def per_chunk(self, virtual_stages: int) -> Costs:
        """Costs of one of ``virtual_stages`` equal chunks of a stage with these costs."""
        v = float(virtual_stages)
        return Costs(self.f / v, self.b / v, self.w / v, self.p2p, self.stage_scale)

    def of(self, action: Action, split_backward: bool) -> float:
        k = action.kind
        if k is ActionKind.F:
            base = self.f
        elif k is ActionKind.B:
            base = self.b if split_backward else self.b + self.w
        elif k is ActionKind.W:
            base = self.w
        else:
            return 0.0
        if self.stage_scale:
            base *= self.stage_scale[action.stage]
        return base


@dataclass(frozen=True, slots=True)
class Interval:
    """One compute action on one rank, from ``start`` to ``end``."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Busy intervals of every pipeline rank (simulated or recorded); the rest is idle."""

    ranks: tuple[tuple[Interval, ...], ...]

    @property
    def makespan(self) -> float:
        return max((iv.end for row in self.ranks for iv in row), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(iv.end - iv.start for iv in self.ranks[rank])

    def idle_intervals(self, rank: int) -> list[tuple[float, float]]:
        """Gaps of ``rank`` within ``[0, makespan]`` (waiting for data, warm-up, cool-down)."""
        out, t = [], 0.0
        for iv in sorted(self.ranks[rank], key=lambda iv: iv.start):
            if iv.start > t:
                out.append((t, iv.start))
            t = max(t, iv.end)
        if self.makespan > t:
            out.append((t, self.makespan))
        return out

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time: ``1 - sum(busy) / (ranks * makespan)``."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(len(self.ranks))) / (len(self.ranks) * span)

    def shifted(self) -> Timeline:
        """The same timeline with its earliest start moved to 0."""
        t0 = min((iv.start for row in self.ranks for iv in row), default=0.0)
        return Timeline(tuple(tuple(Interval(iv.action, iv.start - t0, iv.end - t0) for iv in row)
                              for row in self.ranks))


def simulate(sched: PipelineSchedule, costs: Costs | None = None) -> Timeline:
    """The timeline of ``sched`` under ``costs`` (default: unit F, B, W, free p2p); raises
    :class:`DeadlockError` if the lists cannot complete."""
    costs = costs or Costs()
    if costs.stage_scale and len(costs.stage_scale) != sched.num_stages:
        raise ValueError(f"stage_scale has {len(costs.stage_scale)} entries for "
                         f"{sched.num_stages} stages")
    n, split = sched.num_stages, sched.split_backward
    lists: Sequence[tuple[Action, ...]] = sched.ranks
    pc = [0] * sched.pp
    clock = [0.0] * sched.pp
    sent: dict[Message, float] = {}
    posted: dict[Message, float] = {}
    ready: dict[Message, float] = {}  # local messages: when their producer ended
    rows: list[list[Interval]] = [[] for _ in range(sched.pp)]
    while True:
        moved = False
        for r, acts in enumerate(lists):
            while pc[r] < len(acts):
                a = acts[pc[r]]
                if a.kind.is_send:
                    sent[a.message()] = clock[r]
                elif a.kind.is_recv:
                    posted[a.message()] = clock[r]
                else:
                    start = clock[r]
                    need = needed_message(a, n)
                    if need is not None and sched.is_local(need):  # handed over on this rank
                        if need not in ready:
                            break
                        start = max(start, ready[need])
                    elif need is not None:
                        if need not in sent:
                            break
                        if need not in posted:
                            raise DeadlockError(f"rank {r}: {a} runs before receiving {need}")
                        start = max(start, max(sent[need], posted[need]) + costs.p2p)
                    clock[r] = start + costs.of(a, split)
                    rows[r].append(Interval(a, start, clock[r]))
                    made = produced_message(a, n)
                    if made is not None and sched.is_local(made):
                        ready[made] = clock[r]
                pc[r] += 1
                moved = True
        if all(pc[r] == len(acts) for r, acts in enumerate(lists)):
            return Timeline(tuple(tuple(row) for row in rows))
        if not moved:
            stuck = [f"rank {r} at {lists[r][pc[r]]} waits for "
                     f"{needed_message(lists[r][pc[r]], n)}"
                     for r in range(sched.pp) if pc[r] < len(lists[r])]
            raise DeadlockError(f"{sched.kind.value} pp={sched.pp} V={sched.virtual_stages} "
                                f"M={sched.microbatches} deadlocks: " + "; ".join(stuck))


def textbook_bubble(sched: PipelineSchedule) -> float:
    """The textbook bubble fraction for equal per-stage costs and free p2p:
    ``(pp - 1) / (V*M + pp - 1)`` (V = 1 for GPipe and 1F1B), independent of the F:B ratio.
    ZB-H1 with F = B = W = 1: the makespan is ``3M + pp - 1`` once M >= pp (a third of 1F1B's
    idle time: ``(pp - 1)(F + B - W)`` instead of ``(pp - 1)(F + B + W)``) and
    ``2(M + pp - 1) + 1`` below that (the F and B chains through all stages, then one W). ZBV
    with F = B = W = 1 per stage (1/2 per chunk): ``3M + max((pp - 1) / 2, 2(pp - 1) - (M - 1))``,
    half of ZB-H1's idle time once M is large enough (about ``2pp - 2``). 2BW's steady step (its
    stages start each step together) with F = 1, B + W = 2: makespan ``3M + 2(pp - 1)``, the
    backward chain of the cut only."""
    p, v, m = sched.pp, sched.virtual_stages, sched.microbatches
    if sched.kind is Schedule.TWO_BW:
        return 1.0 - 3 * m / (3 * m + 2 * (p - 1))
    if sched.v_shape:
        return 1.0 - 3 * m / (3 * m + max((p - 1) / 2, 2 * (p - 1) - (m - 1)))
    if sched.split_backward:
        return 1.0 - 3 * m / max(3 * m + p - 1, 2 * (m + p - 1) + 1)
    return (p - 1) / (v * m + p - 1)


def check_schedule(sched: PipelineSchedule) -> None:
    """Structural checks (raise :class:`ScheduleError`): every (micro-batch, stage) has exactly one
    F and one B (and one W iff split) on its own rank in the order F < B < W; every receive comes
    before its consumer and every send after its producer (a local message, between two stages of
    one rank, has neither: its consumer comes after its producer); sends and receives between each pair
    of ranks match one to one, in the same order. Deadlock freedom is
    :func:`simulate`'s job."""
    n, kinds = sched.num_stages, [ActionKind.F] if sched.forward_only else [ActionKind.F, ActionKind.B]
    if sched.split_backward and not sched.forward_only:
        kinds.append(ActionKind.W)
    sent: dict[tuple[int, int], list[Message]] = defaultdict(list)
    received: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for r, acts in enumerate(sched.ranks):
        pos: dict[tuple[ActionKind, int, int], int] = {}
        for i, a in enumerate(acts):
            if sched.rank_of(a.stage) != r or not 0 <= a.microbatch < sched.microbatches:
                raise ScheduleError(f"rank {r} action {i} {a} is not for this rank / micro-batches")
            key = (a.kind, a.microbatch, a.stage)
            if key in pos:
                raise ScheduleError(f"rank {r} runs {a} twice")
            pos[key] = i
            msg = a.message()
            if a.kind.is_send:
                sent[(r, sched.rank_of(msg.dst))].append(msg)
            elif a.kind.is_recv:
                received[(sched.rank_of(msg.src), r)].append(msg)
        for s in sched.stages_of(r):
            for m in range(sched.microbatches):
                order = [pos.get((k, m, s)) for k in kinds]
                if None in order or order != sorted(order):
                    raise ScheduleError(f"rank {r} stage {s} mb {m}: {[k.value for k in kinds]} at "
                                        f"positions {order}")
        for i, a in enumerate(acts):
            if a.kind is ActionKind.W and not sched.split_backward:
                raise ScheduleError(f"rank {r} has {a} in a schedule without split backward")
            need = needed_message(a, n) if a.kind.is_compute else None
            if need is not None and sched.is_local(need):
                if pos.get((a.kind, a.microbatch, need.src), i) >= i:  # F after F, B after B upstream
                    raise ScheduleError(f"rank {r}: {a} at {i} runs before its local producer")
            elif need is not None:
                recv = ActionKind.RECV_ACT if need.payload is Payload.ACT else ActionKind.RECV_GRAD
                if pos.get((recv, a.microbatch, a.stage), i) >= i:
                    raise ScheduleError(f"rank {r}: {a} at {i} has no earlier {recv.value}")
            made = produced_message(a, n) if a.kind.is_compute else None
            if made is not None and not sched.is_local(made):
                send = ActionKind.SEND_ACT if made.payload is Payload.ACT else ActionKind.SEND_GRAD
                if pos.get((send, a.microbatch, a.stage), -1) <= i:
                    raise ScheduleError(f"rank {r}: {a} at {i} has no later {send.value}")
    for pair in set(sent) | set(received):
        if sent[pair] != received[pair]:
            raise ScheduleError(f"ranks {pair[0]} -> {pair[1]}: sends {sent[pair][:4]}... and "
                                f"receives {received[pair][:4]}... differ in content or order")
