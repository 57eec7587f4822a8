"""For one candidate (axes, micro-batch, schedule): the ZeRO stages that fit at the cheapest memory
level (recompute, then activation offload, then the offload ladder), and the smallest evaluation
when none does (:func:`_fitting_options`, the search's memory step; :mod:`hybridpar.planner.search.search`
ranks what fits by step time).

Most layouts the search meets do not fit (the 70B search on 64 GPUs: ~13,000 of ~15,000 memory
evaluations). A layout with pipeline parallelism is first priced on one of its candidate ranks
(:func:`hybridpar.planner.memory.plan.memory_bound`, the worst rank of the candidate's last full
evaluation): that rank's total is a lower bound of the layout's (the worst rank's), so a bound
above the GPU's memory proves the layout does not fit without pricing its other ranks. Such a
layout only matters again as the smallest miss, and that is found exactly (:class:`_Probe`):
bounds in increasing order, each completed while it could still reach the least shortfall found.
The answer is the unpruned one (``tests/test_planner_validation.py`` compares every ZeRO stage at
every level).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hybridpar.config import ModelConfig
from hybridpar.planner.machine.hardware import Cluster, GiB
from hybridpar.planner.memory.plan import MemoryReport, memory_bound, plan_memory
from hybridpar.planner.model.layout import Layout, Workload, layout_rule
from hybridpar.planner.price.cost import CostReport
from hybridpar.rules import Broken

RECOMPUTE = ("none", "selective", "full")
ZERO = (0, 1, 2, 3)
# when nothing fits on the GPUs: ZeRO-3's state to host memory, then its parameter shards too,
# then the same on disk (ZeRO-Offload, then ZeRO-Infinity); the first that fits is proposed
OFFLOAD_LADDER = (("cpu", False), ("cpu", True), ("disk", False), ("disk", True))
# activation offload, tried per recompute level when nothing fits without (memory_levels)
# (all of each chunk's layers: a fraction is the user's choice, parallel.offload_activations_fraction;
# more fractions would double the search's memory evaluations where nothing fits)
OFFLOAD_FRACTIONS = (1.0,)


@dataclass
class Evaluation:
    """One layout's verdict: the rule it breaks, or its memory, fit and predicted cost."""

    layout: Layout
    rule: str | None = None  # the message of the rule it breaks (or of the cluster size it misses)
    memory: MemoryReport | None = None
    cost: CostReport | None = None
    capacity: float = 0.0
    note: str | None = None  # why this version's trainer cannot run it yet
    host_capacity: float = float("inf")  # host memory per GPU, for what offload puts there
    broken: Broken | None = None  # the rule behind ``rule``, when it is one of the rules

    @property
    def reason(self) -> str | None:
        """Why it is rejected, without the fix: what reports group rejected layouts by."""
        return self.broken.reason if self.broken is not None else self.rule

    @property
    def fits(self) -> bool:
        return (self.rule is None and self.memory is not None and self.memory.total <= self.capacity
                and self.memory.cpu_bytes <= self.host_capacity)

    @property
    def shortfall_gib(self) -> float:
        """GiB over capacity (0 when it fits)."""
        if self.memory is None:
            return float("inf")
        return max(0.0, (self.memory.total - self.capacity) / GiB)

    def to_json(self) -> dict[str, object]:
        """The fields ``hybridpar plan --json`` promises for each evaluated layout."""
        out: dict[str, object] = dict(self.layout.as_dict())
        out["memory_gib"] = self.memory.gib() if self.memory else None
        out["fits"] = self.fits
        c = self.cost
        out["step_time_s"] = c.step_time_s if c else None
        out["mfu"] = c.mfu if c else None
        out["tflops_per_gpu"] = c.tflops_per_gpu if c else None
        out["tokens_per_s"] = c.tokens_per_s if c else None
        if self.rule:
            out["rejected"] = self.rule
        elif not self.fits:
            out["rejected"] = f"does not fit: needs {self.shortfall_gib:.2f} GiB more than the GPU has"
        if self.note:
            out["runtime_note"] = self.note
        return out


def _memory_only(model: ModelConfig, layout: Layout, work: Workload, cluster: Cluster, *,
                 rule: Broken | None | bool = False) -> Evaluation:
    """Rules and memory, no cost and no runtime note (``rule``: the rule this shape breaks, or
    None, when already checked; False to check it here)."""
    ev = Evaluation(layout, capacity=cluster.gpu.usable_bytes, host_capacity=cluster.gpu.host_bytes)
    ev.broken = layout_rule(model, layout, work) if rule is False else rule  # type: ignore[assignment]
    if ev.broken is not None:
        ev.rule = ev.broken.message
        return ev
    if layout.world_size != cluster.world_size:
        ev.rule = (f"dp * tp * pp * cp = {layout.world_size} but the cluster has {cluster.world_size} GPUs")
        return ev
    ev.memory = plan_memory(model, layout, work)
    return ev


class _Probe:
    """A candidate's memory evaluations, each layout at most once: a full :class:`Evaluation`, or
    (pipeline layouts whose one-rank bound already exceeds the GPU's memory) just that bound.
    :meth:`smallest` is the unpruned search's smallest miss: the first, in the order visited, of
    those with the least shortfall."""

    def __init__(self, model: ModelConfig, work: Workload, cluster: Cluster) -> None:
        self.model, self.work, self.cluster = model, work, cluster
        self.capacity = cluster.gpu.usable_bytes
        self.seen: dict[Layout, Evaluation | float] = {}
        self.visited: list[Layout] = []
        self.hint: int | None = None  # the worst rank of the last full evaluation

    def __call__(self, layout: Layout) -> Evaluation | float:
        if layout not in self.seen:
            bound = memory_bound(self.model, layout, self.work, self.hint)
            self.seen[layout] = bound if bound is not None and bound > self.capacity else self._full(layout)
        return self.seen[layout]

    def _full(self, layout: Layout) -> Evaluation:
        ev = _memory_only(self.model, layout, self.work, self.cluster, rule=None)
        assert ev.memory is not None
        self.hint = ev.memory.worst_rank
        return ev

    def fits(self, layout: Layout) -> bool:
        got = self(layout)
        return isinstance(got, Evaluation) and got.fits

    def visit(self, layout: Layout) -> Evaluation | float:
        """:meth:`__call__`, noting the order (the smallest miss is the first of the least)."""
        self.visited.append(layout)
        return self(layout)

    def _shortfall(self, got: Evaluation | float) -> float:
        """:attr:`Evaluation.shortfall_gib`, or the least a bound allows (the same arithmetic)."""
        return got.shortfall_gib if isinstance(got, Evaluation) else max(0.0, (got - self.capacity) / GiB)

    def smallest(self) -> Evaluation:
        least = min((self._shortfall(g) for x in self.visited if isinstance(g := self.seen[x], Evaluation)),
                    default=float("inf"))
        for layout in sorted((x for x in self.visited if not isinstance(self.seen[x], Evaluation)),
                             key=lambda x: self._shortfall(self.seen[x])):
            if self._shortfall(self.seen[layout]) > least:
                break  # its total is at least its bound: more than the least shortfall found
            self.seen[layout] = self._full(layout)
            least = min(least, self._shortfall(self.seen[layout]))
        return next(g for x in self.visited if isinstance(g := self.seen[x], Evaluation) and self._shortfall(g) == least)


def _fitting_options(model: ModelConfig, partial: dict[str, object], fixed: dict[str, object],
                     work: Workload, cluster: Cluster) -> tuple[list[Evaluation], Evaluation]:
    """For fixed axes, micro-batch and schedule (SP on when allowed): the evaluations (memory
    only) of every ZeRO stage that fits at the first recompute level where one does, and the
    smallest evaluation overall (or the one that breaks a rule: the rule is the same for all)."""
    tp, cp = int(fixed["tp"]), int(fixed["cp"])  # type: ignore[call-overload]
    sp_default = tp > 1 and work.seq_len % (tp * (2 * cp if cp > 1 else 1)) == 0  # the sp-seq-len rule
    sp = bool(partial.get("sequence_parallel", sp_default))
    levels = memory_levels(partial)
    zeros = [partial["zero_stage"]] if "zero_stage" in partial else list(ZERO)
    zeros = [z for z in zeros if z or "dp_shard" not in partial] or zeros  # dp_shard shards ZeRO-1/2/3 state
    offload = bool(partial.get("offload_optimizer", False))
    compression = str(partial.get("grad_compression", "none"))
    layouts = {(rec, z): Layout(**fixed, sequence_parallel=sp, recompute=str(rec[0]), zero_stage=int(z),  # type: ignore[arg-type, call-overload]
                                offload_optimizer=offload, grad_compression=compression,  # type: ignore[arg-type]
                                offload_activations=rec[1], offload_activations_fraction=rec[2],
                                dp_shard=int(partial.get("dp_shard", 0)))  # type: ignore[call-overload]
               for rec in levels for z in zeros}
    first = layouts[(levels[0], zeros[0])]
    rule = layout_rule(model, first, work)  # the same for all of them
    if rule is not None or first.world_size != cluster.world_size:
        return [], _memory_only(model, first, work, cluster, rule=rule)  # the first one tried says why
    probe = _Probe(model, work, cluster)
    for rec in levels:
        order = list(zeros)
        # ZeRO-1 holds less than ZeRO-0 (equal at dp x cp = 1: ZeRO shards over both), and
        # ZeRO-2 less than ZeRO-1 with one micro-batch per step but more with accumulation
        # (the full gradients plus their shard): if the least of them does not fit, neither do
        # the others
        least = [0] if int(fixed["dp"]) * int(fixed["cp"]) == 1 else [1, 2]  # type: ignore[call-overload]
        if order == list(ZERO) and not any(probe.fits(layouts[(rec, z)]) for z in least):
            order = [*least, 3]
        fits = [got for z in order if isinstance(got := probe.visit(layouts[(rec, z)]), Evaluation) and got.fits]
        if fits:
            return fits, fits[0]
    if not any(k in partial for k in ("offload_optimizer", "offload_to", "offload_params", "zero_stage")):
        # nothing fits on the device: offload ZeRO-3's optimizer state, then its parameter shards,
        # to host memory, and where the host cannot hold them either, to disk (ZeRO-Infinity);
        # activations stay on the device there (host memory is what those offloads compete for)
        base = next((lv for lv in reversed(levels) if not lv[1]), levels[-1])
        for where, params in OFFLOAD_LADDER:
            layout = dataclasses.replace(layouts[(base, 3)], offload_optimizer=True, offload_to=where,  # type: ignore[arg-type]
                                         offload_params=params)
            if probe.fits(layout):
                return [probe.seen[layout]], probe.seen[layout]  # type: ignore[list-item, return-value]
    return [], probe.smallest()


Level = tuple[str, bool, float]  # (recompute, offload_activations, offload_activations_fraction)


def memory_levels(partial: dict[str, object]) -> list[Level]:
    """What the search trades for memory, in order, as far as ``partial`` leaves it open: the
    recompute levels (none < selective < full) without activation offload, then, when not even
    full recomputation fits, each level again offloading all of each chunk's layers
    (:data:`OFFLOAD_FRACTIONS`): offload needs host memory and a host link the step shares, so it
    comes in where recomputation alone cannot make a layout (its micro-batch size) fit, before
    the search has to settle for a smaller micro-batch (another candidate, ranked by step time)."""
    recs = [str(partial["recompute"])] if "recompute" in partial else list(RECOMPUTE)
    if "offload_activations" in partial:
        chosen = bool(partial["offload_activations"])
        fractions = [float(partial.get("offload_activations_fraction", 1.0))]  # type: ignore[arg-type]
        return [(rec, chosen, f) for rec in recs for f in fractions]
    if "offload_activations_fraction" in partial:
        return [(rec, True, float(partial["offload_activations_fraction"])) for rec in recs]  # type: ignore[arg-type]
    return [(rec, False, 1.0) for rec in recs] + [(rec, True, f) for rec in recs for f in OFFLOAD_FRACTIONS]
