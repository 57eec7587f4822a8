"""Enumerate layouts for a cluster, reject those that break a config rule or do not fit, rank the
rest by predicted step time.

No rule of thumb is built in (tp inside a node, pp across nodes, dp last): the search tries every
factorisation ``world = dp * tp * pp * cp`` and lets :func:`hybridpar.config.validate`, the
memory model and the cost model decide. For each factorisation the fields a user leaves out are
filled by the planner: micro-batch size, schedule and virtual stages are searched; sequence
parallelism is on whenever tp > 1 and allowed (same traffic, less memory); recomputation and
the ZeRO stage are the cheapest that fit, in the order none < selective < full and 0 < 1 < 2 < 3.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from hybridpar.config import ModelConfig
from hybridpar.planner.cost import CostReport, step_cost
from hybridpar.planner.hardware import Cluster, GiB
from hybridpar.planner.layout import Layout, Workload, layout_rule_error, runtime_note
from hybridpar.planner.memory import MemoryReport, plan_memory

MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")
ZERO = (0, 1, 2, 3)


@dataclass
class Evaluation:
    """One layout's verdict: the rule it breaks, or its memory, fit and predicted cost."""

    layout: Layout
    rule: str | None = None
    memory: MemoryReport | None = None
    cost: CostReport | None = None
    capacity: float = 0.0
    note: str | None = None  # why this version's trainer cannot run it yet

    @property
    def fits(self) -> bool:
        return self.rule is None and self.memory is not None and self.memory.total <= self.capacity

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


def evaluate(model: ModelConfig, layout: Layout, work: Workload, cluster: Cluster,
             style: str = "llama", with_cost: bool = True) -> Evaluation:
    """Rules, then memory, then (if it fits, or ``with_cost``) predicted cost."""
    ev = Evaluation(layout, capacity=cluster.gpu.hbm_bytes)
    ev.rule = layout_rule_error(model, layout, work)
    if ev.rule is not None:
        return ev
    if layout.world_size != cluster.world_size:
        ev.rule = (f"dp * tp * pp * cp = {layout.world_size} but the cluster has {cluster.world_size} GPUs")
        return ev
    ev.memory = plan_memory(model, layout, work, style)
    if with_cost or ev.fits:
        ev.cost = step_cost(model, layout, work, cluster, style)
    ev.note = runtime_note(model, layout, work)
    return ev


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorisations(world: int) -> Iterable[tuple[int, int, int, int]]:
    """Every ``(dp, tp, pp, cp)`` with product ``world``."""
    for tp in divisors(world):
        for pp in divisors(world // tp):
            for cp in divisors(world // (tp * pp)):
                yield world // (tp * pp * cp), tp, pp, cp


def schedules(model: ModelConfig, pp: int, microbatches: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) to try: 1F1B, ZB-H1, interleaved with V = 2 and 4."""
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("zb-h1", 1)]
    for v in (2, 4):
        if model.n_layers % (pp * v) == 0 and microbatches % pp == 0:
            out.append(("interleaved", v))
    return out


def complete(model: ModelConfig, partial: dict[str, object], work: Workload, cluster: Cluster,
             style: str = "llama") -> tuple[Evaluation, list[Evaluation]]:
    """The best layout agreeing with ``partial`` (``parallel.*`` names + micro_batch); missing
    axes default to 1 except dp, which takes up the rest of the world. Returns the best and
    every evaluation tried (for explanations)."""
    world = cluster.world_size
    base = {k: partial[k] for k in ("tp", "pp", "cp") if k in partial}
    tp, pp, cp = (int(base.get(k, 1)) for k in ("tp", "pp", "cp"))  # type: ignore[call-overload]
    dp = int(partial.get("dp", max(1, world // (tp * pp * cp))))  # type: ignore[call-overload]
    tried: list[Evaluation] = []
    mbs = [partial["micro_batch"]] if "micro_batch" in partial else [
        b for b in MICRO_BATCHES if work.global_batch % (dp * b) == 0] or [1]
    for mb in mbs:
        m = work.global_batch // (dp * int(mb))  # type: ignore[call-overload]
        scheds = schedules(model, pp, m)
        if "pipeline_schedule" in partial:
            v = int(partial.get("virtual_stages", 2 if partial["pipeline_schedule"] == "interleaved" else 1))  # type: ignore[call-overload]
            scheds = [(str(partial["pipeline_schedule"]), v)]
        elif "virtual_stages" in partial:
            scheds = [(s, v) for s, v in scheds if v == partial["virtual_stages"]] or [
                ("interleaved", int(partial["virtual_stages"]))]  # type: ignore[call-overload]
        for sched, v in scheds:
            best = _cheapest_fit(model, dict(partial), dict(dp=dp, tp=tp, pp=pp, cp=cp, micro_batch=mb,
                                 pipeline_schedule=sched, virtual_stages=v), work, cluster, style)
            tried.append(best)
    fitting = [e for e in tried if e.fits and e.cost is not None]
    if fitting:
        return min(fitting, key=lambda e: e.cost.step_time_s), tried  # type: ignore[union-attr]
    ranked = sorted(tried, key=lambda e: (e.rule is not None, e.shortfall_gib))
    return ranked[0], tried


def _cheapest_fit(model: ModelConfig, partial: dict[str, object], fixed: dict[str, object],
                  work: Workload, cluster: Cluster, style: str) -> Evaluation:
    """Given the axes, micro-batch and schedule: SP on when allowed, then the first recompute /
    ZeRO combination (cheapest first) that fits; if none fits, the smallest one."""
    tp, cp = int(fixed["tp"]), int(fixed["cp"])  # type: ignore[call-overload]
    sp_default = tp > 1 and cp == 1 and work.seq_len % tp == 0
    sp = bool(partial.get("sequence_parallel", sp_default))
    recs = [partial["recompute"]] if "recompute" in partial else list(RECOMPUTE)
    zeros = [partial["zero_stage"]] if "zero_stage" in partial else list(ZERO)
    offload = bool(partial.get("offload_optimizer", False))
    smallest: Evaluation | None = None
    for rec in recs:
        for z in zeros:
            layout = Layout(**fixed, sequence_parallel=sp, recompute=str(rec), zero_stage=int(z),  # type: ignore[arg-type]
                            offload_optimizer=offload)
            ev = evaluate(model, layout, work, cluster, style, with_cost=False)
            if ev.rule is not None:
                return ev
            if ev.fits:
                return ev
            if smallest is None or ev.shortfall_gib < smallest.shortfall_gib:
                smallest = ev
    assert smallest is not None
    smallest.cost = step_cost(model, smallest.layout, work, cluster, style)
    return smallest


@dataclass
class SearchResult:
    """Fitting layouts ranked by step time, and what was rejected and why."""

    ranked: list[Evaluation]
    rejected_rules: dict[str, list[Layout]] = field(default_factory=dict)
    too_big: list[Evaluation] = field(default_factory=list)

    def smallest_shortfall(self) -> Evaluation | None:
        return min(self.too_big, key=lambda e: e.shortfall_gib, default=None)


def search(model: ModelConfig, work: Workload, cluster: Cluster, style: str = "llama",
           runnable_only: bool = False) -> SearchResult:
    """Every factorisation of the cluster, completed and ranked (fastest first)."""
    result = SearchResult([])
    for dp, tp, pp, cp in factorisations(cluster.world_size):
        axes = dict(dp=dp, tp=tp, pp=pp, cp=cp)
        probe = Layout(**axes, micro_batch=max(1, min(
            b for b in MICRO_BATCHES if work.global_batch % (dp * b) == 0) if work.global_batch % dp == 0 else 1))
        rule = layout_rule_error(model, probe, work)
        if rule is not None and (work.global_batch % dp != 0 or "micro_batch" not in rule):
            result.rejected_rules.setdefault(rule.split(";")[0], []).append(probe)
            continue
        best, _ = complete(model, axes, work, cluster, style)
        if best.rule is not None:
            result.rejected_rules.setdefault(best.rule.split(";")[0], []).append(best.layout)
        elif best.fits and not (runnable_only and best.note):
            result.ranked.append(best)
        elif not best.fits:
            result.too_big.append(best)
    result.ranked.sort(key=lambda e: e.cost.step_time_s)  # type: ignore[union-attr]
    return result
