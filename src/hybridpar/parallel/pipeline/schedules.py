"""Pipeline schedules as pure data: one ordered list of actions per pipeline rank.

The model is cut into ``S = pp * V`` chunks ("stages", numbered 0..S-1 in model order). With
``V`` virtual stages per rank (interleaved 1F1B), rank ``r`` holds stages ``r, r + pp, r + 2pp,
...`` (Megatron's layout): stage ``s`` lives on rank ``s % pp`` as local chunk ``s // pp``. The
V-shaped schedule (ZBV) places its two chunks per rank as a V: rank ``r`` holds stages ``r`` and
``2pp - 1 - r``, so the first and the last stage share rank 0 and the hand-off from stage
``pp - 1`` to ``pp`` (and back) stays on rank ``pp - 1`` (a local message: no send or receive).

Each rank's list is its compute order (F, B and W per micro-batch and stage, :mod:`.orders`)
with the sends and receives added; the actions and messages are in :mod:`.actions`.

Execution semantics (the runtime implements them, :mod:`.simulate` times them, the tests check
them): sends are posted right after the compute that produces them and never block; receives are
posted one compute ahead of their consumer (prefetch, in the sender's order, since p2p messages
between two ranks match first-in first-out) and only the consuming compute waits for them. Such a
list is deadlock-free exactly when every rank's compute order respects the data dependencies.

No process group is needed to build or check a schedule; the same lists drive the runtime, the
simulator, the timeline plot and the planner.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from hybridpar.parallel.pipeline.actions import (
    Action,
    ActionKind,
    Message,
    Payload,
    Schedule,
    ScheduleError,
    needed_message,
    produced_message,
)
from hybridpar.parallel.pipeline.orders import (
    gpipe_order,
    interleaved_order,
    one_f_one_b_order,
    two_bw_order,
    zb_h1_order,
    zbv_order,
)
from hybridpar.rules import schedule_error

__all__ = [  # the actions' names too: the runtime, simulator and planner import them from here
    "PREFETCH",
    "Action",
    "ActionKind",
    "Message",
    "Payload",
    "PipelineSchedule",
    "Schedule",
    "ScheduleError",
    "build_forward_schedule",
    "build_schedule",
    "build_two_bw_step",
    "check_schedule_args",
    "compute_order",
    "max_in_flight",
    "needed_message",
    "produced_message",
    "promised_in_flight",
    "rank_stages",
    "schedule_warnings",
    "stage_rank",
    "two_bw_carried",
    "two_bw_stream",
]

PREFETCH = 1  # receives are posted this many compute actions before their consumer


@dataclass(frozen=True)
class PipelineSchedule:
    """A complete schedule: ``ranks[r]`` is the ordered action list of pipeline rank ``r``."""

    kind: Schedule
    pp: int
    virtual_stages: int
    microbatches: int
    ranks: tuple[tuple[Action, ...], ...]
    forward_only: bool = False  # only F and activation transfers (evaluation)
    v_shape: bool = False  # ZBV's placement: rank r holds stages r and 2pp - 1 - r

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def split_backward(self) -> bool:
        """True when B computes only input gradients and W the weight gradients."""
        return self.kind in (Schedule.ZB_H1, Schedule.ZBV)

    @property
    def spans_steps(self) -> bool:
        """True when a step's lists start the next step's batch (PipeDream-2BW's warm-up runs in
        the step before): the runner must carry stored forwards and two weight versions from
        step to step (:class:`~hybridpar.parallel.pipeline.twobw.TwoBWRunner`)."""
        return self.kind is Schedule.TWO_BW

    def rank_of(self, stage: int) -> int:
        return stage_rank(stage, self.pp, self.v_shape)

    def stages_of(self, rank: int) -> list[int]:
        """The stages rank ``rank`` holds, in local-chunk order."""
        return rank_stages(rank, self.pp, self.virtual_stages, self.v_shape)

    def is_local(self, msg: Message) -> bool:
        """Whether ``msg`` goes between two stages of one rank (handed over, not sent)."""
        return self.rank_of(msg.src) == self.rank_of(msg.dst)

    def compute_actions(self, rank: int) -> list[Action]:
        return [a for a in self.ranks[rank] if a.kind.is_compute]

    def promised_in_flight(self, rank: int) -> int:
        if self.forward_only:
            return 0
        return promised_in_flight(self.kind, self.pp, self.virtual_stages, self.microbatches, rank)



def stage_rank(stage: int, pp: int, v_shape: bool = False) -> int:
    """The rank stage ``stage`` lives on: ``stage % pp``, or as a V (``2pp - 1 - stage`` past the
    turn)."""
    if v_shape and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def rank_stages(rank: int, pp: int, virtual_stages: int, v_shape: bool = False) -> list[int]:
    """The stages rank ``rank`` holds, in local-chunk order (model order)."""
    if v_shape:
        return [rank, 2 * pp - 1 - rank]
    return [v * pp + rank for v in range(virtual_stages)]


# ----------------------------------------------------------------------------- argument rules


def check_schedule_args(kind: Schedule, pp: int, virtual_stages: int, microbatches: int) -> None:
    """Raise :class:`ScheduleError` (one line, numbers and fix) if the schedule cannot exist."""
    if pp < 1 or virtual_stages < 1 or microbatches < 1:
        raise ScheduleError(f"pipeline needs pp >= 1, virtual_stages >= 1, microbatches >= 1; got "
                            f"pp = {pp}, virtual_stages = {virtual_stages}, microbatches = {microbatches}")
    message = schedule_error(kind.value, pp, virtual_stages, microbatches)  # the run's rules, stated once
    if message is not None:
        raise ScheduleError(message)


def schedule_warnings(kind: Schedule, pp: int, virtual_stages: int, microbatches: int) -> list[str]:
    """Legal but wasteful settings, as one-line messages."""
    out = []
    if pp > 1 and microbatches < pp:
        bubble = (pp - 1) / (microbatches + pp - 1)
        out.append(f"microbatches = {microbatches} < pp = {pp}: the pipeline is bubble-dominated "
                   f"(about {bubble:.0%} idle with {kind.value}); use at least {pp}, ideally >= {4 * pp}")
    return out


def promised_in_flight(kind: Schedule, pp: int, virtual_stages: int, microbatches: int,
                       rank: int) -> int:
    """Peak number of (micro-batch, chunk) activations rank ``rank`` holds at once.

    GPipe: M. 1F1B, and 2BW (a step's carried warm-up forwards included): ``min(pp - rank, M)``.
    Interleaved (counted in chunks, each 1/V of a stage):
    ``min(V*M, 2*(pp - rank - 1) + (V - 1)*pp + 1)``, or ``V*M`` when M == pp (all forwards
    first, as Megatron does). ZBV (in chunks, each half a stage):
    ``min(2pp, 2M, M + 1 + rank)``: ``2pp`` on every rank once ``M >= 2pp - 1``, as much as
    1F1B's first stage holds.
    ZB-H1 keeps a record from F until W (the chunk's
    activations until B, then only what the deferred weight gradients need, :mod:`.wsplit`), and
    rank r defers its W by r micro-batches: ``min(pp, M)`` on every rank (the peak of 1F1B's
    first stage).
    """
    m, v = microbatches, virtual_stages
    if kind is Schedule.GPIPE:
        return m
    if kind in (Schedule.ONE_F_ONE_B, Schedule.TWO_BW):
        return min(pp - rank, m)
    if kind is Schedule.ZB_H1:
        return min(pp, m)
    if kind is Schedule.ZBV:
        return min(2 * pp, 2 * m, m + 1 + rank)
    if m == pp:
        return v * m
    return min(v * m, 2 * (pp - rank - 1) + (v - 1) * pp + 1)


def max_in_flight(actions: Sequence[Action]) -> int:
    """Peak number of stored activations along one rank's list: +1 at F, -1 when the last
    backward action of that (micro-batch, stage) runs (W if the list has one, else B)."""
    release = {(a.microbatch, a.stage): a.kind for a in actions
               if a.kind in (ActionKind.B, ActionKind.W)}
    live = peak = 0
    for a in actions:
        if a.kind is ActionKind.F:
            live += 1
            peak = max(peak, live)
        elif a.kind.is_compute and release.get((a.microbatch, a.stage)) is a.kind:
            live -= 1
    return peak


def two_bw_carried(pp: int, m: int) -> tuple[Message, ...]:
    """The activations a 2BW step with a tail leaves for the next one: rank r's last warm-up
    forward of the next batch (micro-batch ``m + pp - 2 - r``, for r < pp - 1) feeds rank
    r + 1's first forward of the next step; it is sent at the head of that step (numbered there
    as micro-batch ``pp - 2 - r`` of its own batch), so every step's messages stay inside it."""
    return tuple(Message(Payload.ACT, m + pp - 2 - r, r, r + 1) for r in range(pp - 1))


def build_two_bw_step(pp: int, microbatches: int, head: bool, tail: bool) -> PipelineSchedule:
    """The action lists of one 2BW step (:func:`_two_bw`; the rules: :func:`check_schedule_args`).
    Micro-batches ``>= microbatches`` are the next batch's. Without ``head`` each rank first
    sends what the previous step left (:func:`two_bw_carried`); with ``tail`` those activations
    are produced but not sent."""
    check_schedule_args(Schedule.TWO_BW, pp, 1, microbatches)
    m = microbatches
    carried = two_bw_carried(pp, m)
    first = () if head else tuple(Message(c.payload, c.microbatch - m, c.src, c.dst) for c in carried)
    compute = [two_bw_order(pp, m, r, head, tail) for r in range(pp)]
    ranks = _insert_comms(compute, pp, pp, sent_first=first, held=frozenset(carried) if tail else frozenset())
    return PipelineSchedule(Schedule.TWO_BW, pp, 1, m, ranks)


def two_bw_stream(pp: int, microbatches: int, steps: int) -> PipelineSchedule:
    """``steps`` consecutive 2BW steps (the first with a head, the last without a tail) as one
    schedule of ``steps * microbatches`` micro-batches, step k's numbered from ``k * microbatches``:
    the continuous stream the steps are cut from, for :func:`~.simulate.check_schedule` and
    :func:`~.simulate.simulate`."""
    m = microbatches
    rows: list[list[Action]] = [[] for _ in range(pp)]
    for k in range(steps):
        step = build_two_bw_step(pp, m, head=k == 0, tail=k < steps - 1)
        for r, acts in enumerate(step.ranks):
            rows[r] += [Action(a.kind, a.microbatch + k * m, a.stage) for a in acts]
    return PipelineSchedule(Schedule.TWO_BW, pp, 1, steps * m, tuple(tuple(r) for r in rows))


# ----------------------------------------------------------------------------- communication


def _insert_comms(compute: list[list[Action]], pp: int, num_stages: int, v_shape: bool = False,
                  sent_first: Sequence[Message] = (), held: frozenset[Message] = frozenset()
                  ) -> tuple[tuple[Action, ...], ...]:
    """Add send/recv actions to per-rank compute orders (see the module docstring): each send
    right after its producer; each receive ``PREFETCH`` computes before its consumer, moved
    earlier where needed so receives from one peer are posted in that peer's send order.
    Messages between two stages of one rank get neither. ``sent_first``: messages produced
    before these lists (2BW's previous step), sent first thing; ``held``: produced here but
    sent by the next lists."""
    def remote(msg: Message | None) -> bool:
        return msg is not None and stage_rank(msg.src, pp, v_shape) != stage_rank(msg.dst, pp, v_shape)

    sends: dict[tuple[int, int], list[Message]] = defaultdict(list)  # (src rank, dst rank) -> FIFO
    for msg in sent_first:
        sends[(stage_rank(msg.src, pp, v_shape), stage_rank(msg.dst, pp, v_shape))].append(msg)
    for r, acts in enumerate(compute):
        for a in acts:
            msg = produced_message(a, num_stages)
            if remote(msg) and msg not in held:
                sends[(r, stage_rank(msg.dst, pp, v_shape))].append(msg)
    out = []
    for r, acts in enumerate(compute):
        consumer = {}
        for i, a in enumerate(acts):
            msg = needed_message(a, num_stages)
            if remote(msg):
                consumer[msg] = i
        slots: list[list[Message]] = [[] for _ in acts]
        for src in range(pp):
            nxt = len(acts) - 1
            for msg in reversed(sends.get((src, r), [])):
                if msg not in consumer:
                    raise ScheduleError(f"rank {r} never consumes {msg} that rank {src} sends")
                nxt = min(max(0, consumer[msg] - PREFETCH), nxt)
                slots[nxt].append(msg)
        seq = [Action(ActionKind.SEND_ACT if msg.payload is Payload.ACT else ActionKind.SEND_GRAD,
                      msg.microbatch, msg.src) for msg in sent_first if stage_rank(msg.src, pp, v_shape) == r]
        for i, a in enumerate(acts):
            for msg in reversed(slots[i]):  # appended newest-first per source
                kind = ActionKind.RECV_ACT if msg.payload is Payload.ACT else ActionKind.RECV_GRAD
                seq.append(Action(kind, msg.microbatch, msg.dst))
            seq.append(a)
            msg = produced_message(a, num_stages)
            if remote(msg) and msg not in held:
                kind = ActionKind.SEND_ACT if msg.payload is Payload.ACT else ActionKind.SEND_GRAD
                seq.append(Action(kind, a.microbatch, a.stage))
        out.append(tuple(seq))
    return tuple(out)


def build_schedule(kind: Schedule | str, pp: int, virtual_stages: int = 1,
                   microbatches: int = 1) -> PipelineSchedule:
    """The per-rank action lists of schedule ``kind`` for ``pp`` ranks, ``virtual_stages`` chunks
    per rank and ``microbatches`` micro-batches (rules: :func:`check_schedule_args`). For 2BW: its
    steady step (:func:`build_two_bw_step` with a head and a tail: what every step but the first
    and the last runs)."""
    kind = Schedule.parse(kind)
    if kind is Schedule.TWO_BW:
        return build_two_bw_step(pp, microbatches, head=False, tail=True)
    check_schedule_args(kind, pp, virtual_stages, microbatches)
    m, v = microbatches, virtual_stages
    if kind is Schedule.GPIPE:
        compute = [gpipe_order(pp, m, r) for r in range(pp)]
    elif kind is Schedule.ONE_F_ONE_B:
        compute = [one_f_one_b_order(pp, m, r) for r in range(pp)]
    elif kind is Schedule.INTERLEAVED:
        compute = [interleaved_order(pp, v, m, r) for r in range(pp)]
    elif kind is Schedule.ZBV:
        compute = [zbv_order(pp, m, r) for r in range(pp)]
    else:
        compute = [zb_h1_order(pp, m, r) for r in range(pp)]
    v_shape = kind is Schedule.ZBV
    return PipelineSchedule(kind, pp, v, m, _insert_comms(compute, pp, pp * v, v_shape), v_shape=v_shape)


def compute_order(kind: Schedule | str, pp: int, virtual_stages: int, microbatches: int,
                  rank: int) -> list[Action]:
    """Rank ``rank``'s compute actions (F, B, W) in the order :func:`build_schedule` gives them,
    without the send/recv actions (cheap: for memory models that only need the order). 2BW:
    its first step with a tail (its peak of stored activations is every step's: a steady step
    starts holding the warm-up forwards the previous one ran)."""
    kind = Schedule.parse(kind)
    check_schedule_args(kind, pp, virtual_stages, microbatches)
    if kind is Schedule.TWO_BW:
        return two_bw_order(pp, microbatches, rank, head=True, tail=True)
    if kind is Schedule.GPIPE:
        return gpipe_order(pp, microbatches, rank)
    if kind is Schedule.ONE_F_ONE_B:
        return one_f_one_b_order(pp, microbatches, rank)
    if kind is Schedule.INTERLEAVED:
        return interleaved_order(pp, virtual_stages, microbatches, rank)
    if kind is Schedule.ZBV:
        return zbv_order(pp, microbatches, rank)
    return zb_h1_order(pp, microbatches, rank)


def build_forward_schedule(pp: int, virtual_stages: int, microbatches: int,
                           v_shape: bool = False) -> PipelineSchedule:
    """Forward-only lists for evaluation, for any number of micro-batches: each rank runs all
    micro-batches through its first chunk, then its second, ... (a topological order: the input
    of chunk v on rank 0 comes from chunk v-1 of the last rank, finished earlier; under
    ``v_shape``, that of chunk 1 on rank r from chunk 1 of rank r + 1, or from its own chunk 0 on
    the last rank)."""
    if pp < 1 or virtual_stages < 1 or microbatches < 1 or (virtual_stages > 1 and pp < 2 and not v_shape):
        raise ScheduleError(f"forward schedule needs pp, virtual_stages, microbatches >= 1 (pp >= 2 "
                            f"with virtual stages); got {pp}, {virtual_stages}, {microbatches}")
    compute = [[Action(ActionKind.F, m, s) for s in rank_stages(r, pp, virtual_stages, v_shape) for m in range(microbatches)]
               for r in range(pp)]
    return PipelineSchedule(Schedule.GPIPE, pp, virtual_stages, microbatches,
                            _insert_comms(compute, pp, pp * virtual_stages, v_shape), forward_only=True,
                            v_shape=v_shape)
