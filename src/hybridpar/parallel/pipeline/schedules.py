"""Pipeline schedules as pure data: one ordered list of actions per pipeline rank.

The model is cut into ``S = pp * V`` chunks ("stages", numbered 0..S-1 in model order). With
``V`` virtual stages per rank (interleaved 1F1B), rank ``r`` holds stages ``r, r + pp, r + 2pp,
...`` (Megatron's layout): stage ``s`` lives on rank ``s % pp`` as local chunk ``s // pp``. The
V-shaped schedule (ZBV) places its two chunks per rank as a V: rank ``r`` holds stages ``r`` and
``2pp - 1 - r``, so the first and the last stage share rank 0 and the hand-off from stage
``pp - 1`` to ``pp`` (and back) stays on rank ``pp - 1`` (a local message: no send or receive).

Every :class:`Action` is tagged with a micro-batch and the stage it runs on (always a stage of
the rank that executes it):

* ``F``: forward; ``B``: backward. In GPipe / 1F1B / interleaved, B is the full backward. In
  ZB-H1 and ZBV (``schedule.split_backward``) B computes only the input gradient and ``W`` the
  weight gradient later, filling pipeline bubbles.
* ``SEND_ACT`` sends the output of stage ``s`` to stage ``s + 1``; ``RECV_ACT`` receives the
  input of stage ``s`` from ``s - 1``; ``SEND_GRAD`` sends the input gradient of ``s`` to
  ``s - 1``; ``RECV_GRAD`` receives the output gradient of ``s`` from ``s + 1``.

Execution semantics (the runtime implements them, :mod:`.simulate` times them, the tests check
them): sends are posted right after the compute that produces them and never block; receives are
posted one compute ahead of their consumer (prefetch, in the sender's order, since p2p messages
between two ranks match first-in first-out) and only the consuming compute waits for them. Such a
list is deadlock-free exactly when every rank's compute order respects the data dependencies.

No process group is needed to build or check a schedule; the same lists drive the runtime, the
simulator, the timeline plot and the planner.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from hybridpar.errors import UserError
from hybridpar.rules import schedule_error

PREFETCH = 1  # receives are posted this many compute actions before their consumer


class ScheduleError(UserError):
    """Impossible schedule arguments (pp, virtual stages, micro-batches) or a malformed list."""


class Schedule(enum.Enum):
    """The pipeline schedules; values are the config / CLI names."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"
    ZBV = "zbv"
    TWO_BW = "2bw"  # PipeDream-2BW: asynchronous, one step of gradient delay (see :mod:`.twobw`)

    @classmethod
    def parse(cls, name: str | Schedule) -> Schedule:
        if isinstance(name, Schedule):
            return name
        try:
            return cls(name)
        except ValueError:
            raise ScheduleError(f"unknown pipeline schedule {name!r}; choose one of "
                                f"{[s.value for s in cls]}") from None


class ActionKind(enum.Enum):
    F = "F"
    B = "B"
    W = "W"
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.F, ActionKind.B, ActionKind.W)

    @property
    def is_send(self) -> bool:
        return self in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)


class Payload(enum.Enum):
    ACT = "act"
    GRAD = "grad"


@dataclass(frozen=True, slots=True)
class Message:
    """One p2p transfer: ``payload`` of ``microbatch`` from stage ``src`` to stage ``dst``."""

    payload: Payload
    microbatch: int
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a rank's list: ``kind`` on ``microbatch`` at global stage ``stage``."""

    kind: ActionKind
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind.value}(mb={self.microbatch}, stage={self.stage})"

    def message(self) -> Message | None:
        """The transfer a send or receive action takes part in (None for compute)."""
        k, m, s = self.kind, self.microbatch, self.stage
        if k is ActionKind.SEND_ACT:
            return Message(Payload.ACT, m, s, s + 1)
        if k is ActionKind.RECV_ACT:
            return Message(Payload.ACT, m, s - 1, s)
        if k is ActionKind.SEND_GRAD:
            return Message(Payload.GRAD, m, s, s - 1)
        if k is ActionKind.RECV_GRAD:
            return Message(Payload.GRAD, m, s + 1, s)
        return None


def needed_message(a: Action, num_stages: int) -> Message | None:
    """The message compute action ``a`` must receive before it can run (None: local inputs)."""
    if a.kind is ActionKind.F and a.stage > 0:
        return Message(Payload.ACT, a.microbatch, a.stage - 1, a.stage)
    if a.kind is ActionKind.B and a.stage < num_stages - 1:
        return Message(Payload.GRAD, a.microbatch, a.stage + 1, a.stage)
    return None


def produced_message(a: Action, num_stages: int) -> Message | None:
    """The message compute action ``a`` sends when it finishes (None: nothing leaves the rank)."""
    if a.kind is ActionKind.F and a.stage < num_stages - 1:
        return Message(Payload.ACT, a.microbatch, a.stage, a.stage + 1)
    if a.kind is ActionKind.B and a.stage > 0:
        return Message(Payload.GRAD, a.microbatch, a.stage, a.stage - 1)
    return None


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


# ----------------------------------------------------------------------------- compute orders


def _f(m: int, s: int) -> Action:
    return Action(ActionKind.F, m, s)


def _b(m: int, s: int) -> Action:
    return Action(ActionKind.B, m, s)


def _gpipe(pp: int, m: int, rank: int) -> list[Action]:
    """All forwards, then all backwards (micro-batch order, as torch's ScheduleGPipe)."""
    return [_f(i, rank) for i in range(m)] + [_b(i, rank) for i in range(m)]


def _one_f_one_b(pp: int, m: int, rank: int) -> list[Action]:
    """``pp - 1 - rank`` warm-up forwards, then alternate F and B, then the remaining Bs."""
    warmup = min(pp - 1 - rank, m)
    out = [_f(i, rank) for i in range(warmup)]
    for i in range(m - warmup):
        out += [_f(warmup + i, rank), _b(i, rank)]
    return out + [_b(i, rank) for i in range(m - warmup, m)]


def _interleaved(pp: int, v: int, m: int, rank: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B (needs ``m % pp == 0``). The k-th forward of a rank runs
    micro-batch ``(k // (pp*v))*pp + k % pp`` on local chunk ``(k % (pp*v)) // pp``; backwards
    use the same micro-batch order on chunks in reverse. Warm-up is
    ``2*(pp - rank - 1) + (v - 1)*pp`` forwards (all of them when m == pp)."""
    total = m * v

    def mb(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    def chunk(k: int, forward: bool) -> int:
        c = (k % (pp * v)) // pp
        return c if forward else v - 1 - c

    def fwd(k: int) -> Action:
        return _f(mb(k), chunk(k, True) * pp + rank)

    def bwd(k: int) -> Action:
        return _b(mb(k), chunk(k, False) * pp + rank)

    warmup = total if m == pp else min(total, 2 * (pp - rank - 1) + (v - 1) * pp)
    out = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [fwd(warmup + k), bwd(k)]
    return out + [bwd(k) for k in range(total - warmup, total)]


def _zb_h1(pp: int, m: int, rank: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2023, as torch's ZB1P at one stage per rank): 1F1B with B split into
    an input-gradient B and a weight-gradient W; rank r runs each W r backwards after its B, so
    downstream Bs (the critical path) go first and the deferred Ws fill the cool-down bubble."""
    warmup = min(pp - 1 - rank, m)
    out = [_f(i, rank) for i in range(warmup)]
    backwards = 0
    weights = 0

    def backward() -> None:
        nonlocal backwards, weights
        out.append(_b(backwards, rank))
        if backwards >= rank:
            out.append(Action(ActionKind.W, weights, rank))
            weights += 1
        backwards += 1

    for i in range(m - warmup):
        out.append(_f(warmup + i, rank))
        backward()
    while backwards < m:
        backward()
    out += [Action(ActionKind.W, i, rank) for i in range(weights, m)]
    return out


def _zbv(pp: int, m: int, rank: int) -> list[Action]:
    """ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 6; the order torch's
    ScheduleZBVZeroBubble also uses): rank r runs chunk 0 = stage r and chunk 1 = stage
    2pp - 1 - r. Warm-up: ``2(pp - r) - 1`` forwards of chunk 0, then ``r`` pairs (chunk 1,
    chunk 0), then ``pp - r`` rounds of chunk 1's F, B, W; steady state: F, B, W of chunk 0 then
    of chunk 1; cool-down: the remaining Bs with the Ws deferred into the drain. The order is
    built for ``max(M, 2pp - 1)`` micro-batches and the ones past M are dropped."""
    n = max(2 * pp - 1, m)
    c0, c1 = rank, 2 * pp - 1 - rank
    out: list[Action] = []
    f0 = f1 = b0 = b1 = 0

    def w(mb: int, stage: int) -> Action:
        return Action(ActionKind.W, mb, stage)

    for _ in range(2 * (pp - rank) - 1):
        out.append(_f(f0, c0))
        f0 += 1
    for _ in range(rank):
        out += [_f(f1, c1), _f(f0, c0)]
        f1, f0 = f1 + 1, f0 + 1
    for _ in range(pp - rank):
        out += [_f(f1, c1), _b(b1, c1), w(b1, c1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            out.append(_f(f0, c0))
            f0 += 1
        out += [_b(b0, c0), w(b0, c0), _f(f1, c1), _b(b1, c1), w(b1, c1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        out += [_b(b0, c0), _b(b1, c1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(pp - rank):
        out += [_b(b0, c0), w(w0, c0)]
        b0, w0 = b0 + 1, w0 + 1
    out += [w(i, c1) for i in range(w1, b1)] + [w(i, c0) for i in range(w0, b0)]
    return [a for a in out if a.microbatch < m]


def _two_bw(pp: int, m: int, rank: int, head: bool = True, tail: bool = False) -> list[Action]:
    """One PipeDream-2BW step of rank ``rank``: a cut of one continuous 1F1B stream. ``head``:
    the step runs this batch's ``pp - 1 - rank`` warm-up forwards itself (the first step after
    a start or a resume; otherwise the previous step ran them). Then 1F1B pairs: the forward of
    each pair runs this batch's remaining micro-batches, then, with ``tail``, the next batch's
    first ``pp - 1 - rank`` (numbered ``m + i``); the backward runs this batch's in order.
    Without ``tail`` (the last step) the Bs left over drain the pipeline as in 1F1B, so
    ``head and not tail`` is exactly 1F1B."""
    warmup = min(pp - 1 - rank, m)
    out = [_f(i, rank) for i in range(warmup)] if head else []
    forwards = list(range(warmup, m)) + (list(range(m, m + warmup)) if tail else [])
    for i, mb in enumerate(forwards):
        out += [_f(mb, rank), _b(i, rank)]
    return out + [_b(i, rank) for i in range(len(forwards), m)]


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
    compute = [_two_bw(pp, m, r, head, tail) for r in range(pp)]
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
        compute = [_gpipe(pp, m, r) for r in range(pp)]
    elif kind is Schedule.ONE_F_ONE_B:
        compute = [_one_f_one_b(pp, m, r) for r in range(pp)]
    elif kind is Schedule.INTERLEAVED:
        compute = [_interleaved(pp, v, m, r) for r in range(pp)]
    elif kind is Schedule.ZBV:
        compute = [_zbv(pp, m, r) for r in range(pp)]
    else:
        compute = [_zb_h1(pp, m, r) for r in range(pp)]
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
        return _two_bw(pp, microbatches, rank, head=True, tail=True)
    if kind is Schedule.GPIPE:
        return _gpipe(pp, microbatches, rank)
    if kind is Schedule.ONE_F_ONE_B:
        return _one_f_one_b(pp, microbatches, rank)
    if kind is Schedule.INTERLEAVED:
        return _interleaved(pp, virtual_stages, microbatches, rank)
    if kind is Schedule.ZBV:
        return _zbv(pp, microbatches, rank)
    return _zb_h1(pp, microbatches, rank)


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
    compute = [[_f(m, s) for s in rank_stages(r, pp, virtual_stages, v_shape) for m in range(microbatches)]
               for r in range(pp)]
    return PipelineSchedule(Schedule.GPIPE, pp, virtual_stages, microbatches,
                            _insert_comms(compute, pp, pp * virtual_stages, v_shape), forward_only=True,
                            v_shape=v_shape)
