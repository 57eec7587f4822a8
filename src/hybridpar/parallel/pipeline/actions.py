"""The vocabulary of pipeline schedules (:mod:`.schedules`): the schedule kinds, the actions a
rank's list holds and the p2p messages they exchange.

Every :class:`Action` is tagged with a micro-batch and the stage it runs on (always a stage of
the rank that executes it):

* ``F``: forward; ``B``: backward. In GPipe / 1F1B / interleaved, B is the full backward. In
  ZB-H1 and ZBV (``schedule.split_backward``) B computes only the input gradient and ``W`` the
  weight gradient later, filling pipeline bubbles.
* ``SEND_ACT`` sends the output of stage ``s`` to stage ``s + 1``; ``RECV_ACT`` receives the
  input of stage ``s`` from ``s - 1``; ``SEND_GRAD`` sends the input gradient of ``s`` to
  ``s - 1``; ``RECV_GRAD`` receives the output gradient of ``s`` from ``s + 1``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hybridpar.errors import UserError


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
