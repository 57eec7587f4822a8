"""What a rule is, the ordered table of them, and how to ask it.

A check takes the whole :class:`~hybridpar.config.Config` (and the world size, when known).
The rules the runtime also asks outside a validated run (a model's shape, its tensor-parallel
split, a pipeline's schedule) are written on just the parts they read, so the runtime can ask
them with plain values: this package never builds a ``Config`` and never imports
:mod:`hybridpar.config` except for type names, which keeps the dependency one way
(``config`` -> ``rules``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from hybridpar.errors import without_fix

if TYPE_CHECKING:
    from hybridpar.config import Config, ModelConfig

Check = Callable[["Config", "int | None"], "str | None"]
ModelCheck = Callable[["ModelConfig"], "str | None"]
TpCheck = Callable[["ModelConfig", int], "str | None"]


@dataclass(frozen=True)
class Rule:
    """One rule: its name and its check (``None`` = kept, else the message)."""

    name: str
    check: Check


class Broken(NamedTuple):
    """A rule a config breaks and its message. Every message reads ``what is wrong; the fix``
    (the fix may be absent): :attr:`reason` is the part before the fix, what a report listing
    many rejected layouts groups them by."""

    rule: Rule
    message: str

    @property
    def reason(self) -> str:
        """The message without its fix."""
        return without_fix(self.message)


class PipelineShape(NamedTuple):
    """What the pipeline-schedule rules read: the schedule, its ranks and chunks, the
    micro-batches per step and the batch sizes they come from (for the messages)."""

    pipeline_schedule: str
    pp: int
    virtual_stages: int
    microbatches: int
    dp: int
    global_batch: int
    micro_batch: int

    @classmethod
    def of(cls, cfg: Config) -> PipelineShape:
        p, t = cfg.parallel, cfg.train
        return cls(p.pipeline_schedule, p.pp, p.virtual_stages, cfg.microbatches, p.dp, t.global_batch, t.micro_batch)


PipelineCheck = Callable[[PipelineShape], "str | None"]

RULES: list[Rule] = []
MODEL_CHECKS: list[ModelCheck] = []  # the model-* rules, in order
TP_CHECKS: list[TpCheck] = []  # the tp-* rules, in order
PIPELINE_CHECKS: list[PipelineCheck] = []  # the schedule rules (virtual-*, interleaved-*, pp-2bw-microbatches)


def rule(name: str) -> Callable[[Check], Check]:
    """Register the decorated check as rule ``name`` (in definition order)."""
    def register(fn: Check) -> Check:
        RULES.append(Rule(name, fn))
        return fn
    return register


def model_rule(name: str) -> Callable[[ModelCheck], ModelCheck]:
    """Register ``fn(model)`` as rule ``name``, also asked by :func:`hybridpar.rules.model_error`."""
    def register(fn: ModelCheck) -> ModelCheck:
        RULES.append(Rule(name, lambda cfg, world: fn(cfg.model)))
        MODEL_CHECKS.append(fn)
        return fn
    return register


def tp_rule(name: str) -> Callable[[TpCheck], TpCheck]:
    """Register ``fn(model, tp)`` as rule ``name``, also asked by :func:`hybridpar.rules.tp_split_error`."""
    def register(fn: TpCheck) -> TpCheck:
        RULES.append(Rule(name, lambda cfg, world: fn(cfg.model, cfg.parallel.tp)))
        TP_CHECKS.append(fn)
        return fn
    return register


def pipeline_rule(name: str) -> Callable[[PipelineCheck], PipelineCheck]:
    """Register ``fn(shape)`` as rule ``name``, also asked by :func:`hybridpar.rules.schedule_error`."""
    def register(fn: PipelineCheck) -> PipelineCheck:
        RULES.append(Rule(name, lambda cfg, world: fn(PipelineShape.of(cfg))))
        PIPELINE_CHECKS.append(fn)
        return fn
    return register


def first_message(checks: list[Callable[..., str | None]], *args: object) -> str | None:
    """The first message of ``checks`` asked with ``args``, or None."""
    for check in checks:
        if (message := check(*args)) is not None:
            return message
    return None


def first_broken(cfg: Config, world_size: int | None = None, skip: tuple[str, ...] = (),
                 only: tuple[str, ...] = ()) -> Broken | None:
    """The first rule ``cfg`` breaks and its message, or None; rules whose names start with one of
    ``skip`` are not asked (those that do not apply to a caller, by name), and with ``only``, just
    the rules whose names start with one of those."""
    for r in RULES:
        if (skip and r.name.startswith(skip)) or (only and not r.name.startswith(only)):
            continue
        message = r.check(cfg, world_size)
        if message is not None:
            return Broken(r, message)
    return None
