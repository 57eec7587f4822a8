"""Enumerate layouts for a cluster, reject those that break a config rule or do not fit, rank the
rest by predicted step time (less memory first when step times tie).

No rule of thumb is built in (tp inside a node, pp across nodes, dp last): the search tries every
factorisation ``world = dp * tp * pp * cp`` (and, for a mixture-of-experts model, every expert
parallel degree ``ep`` carved out of dp x cp that divides the number of experts: each
``(dp, tp, pp, cp, ep)`` is ranked as a layout of its own) and lets :func:`hybridpar.config.validate`, the
memory model and the cost model decide. For each factorisation the fields a user leaves out are
filled by the planner: micro-batch size, schedule and virtual stages are searched; sequence
parallelism is on whenever tp > 1 and allowed (same traffic, less memory); recomputation is the
cheapest level at which some ZeRO stage fits (none < selective < full: recomputing only adds
time; then the same levels with activation offload of all of each chunk's layers,
:func:`memory_levels`), and among the ZeRO stages that fit there the fastest, the one with less memory on a tie
(ZeRO-2 over ZeRO-1 over ZeRO-0 when their step times are equal).

Speed (user + sys CPU s, 2 loaded cores, ~1 s torch's import): 8B on 8 GPUs 1.7-1.9, 70B on 64
4.1-4.6. Memory before time, cached per shape, only the pipeline ranks that can be the worst; a
layer priced once per set of the fields it reads (:func:`~hybridpar.planner.price.cost.priced_layer`);
the schedule simulated only where the lower bound (the busiest rank's compute) can still win.
Pruning never changes the answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from hybridpar.config import ModelConfig
from hybridpar.planner.machine.hardware import Cluster, GiB
from hybridpar.planner.memory.plan import MemoryReport, plan_memory
from hybridpar.planner.model.hsdp import shard_sizes
from hybridpar.planner.model.layout import Layout, Workload, layout_rule, runtime_note
from hybridpar.planner.price.cost import CostReport, step_cost
from hybridpar.planner.search.cp_modes import cp_fields
from hybridpar.rules import Broken

MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE = ("none", "selective", "full")
ZERO = (0, 1, 2, 3)
# when nothing fits on the GPUs: ZeRO-3's state to host memory, then its parameter shards too,
# then the same on disk (ZeRO-Offload, then ZeRO-Infinity); the first that fits is proposed
OFFLOAD_LADDER = (("cpu", False), ("cpu", True), ("disk", False), ("disk", True))
# activation offload, tried per recompute level when nothing fits without (memory_levels)
# (all of each chunk's layers: a fraction is the user's choice, parallel.offload_activations_fraction;
# more fractions would double the search's memory evaluations where nothing fits)
OFFLOAD_FRACTIONS = (1.0,)
TIE_DIGITS = 9  # step times equal to this many significant digits tie; memory decides
PRUNE_MARGIN = 1e-7  # a bound this far (relative) above the best may still tie after rounding
# the rules (by name) that another micro-batch size may mend: a factorisation whose probe breaks
# one of them is completed anyway (its other micro-batch sizes are tried)
MICRO_BATCH_RULES = frozenset({"dp-divides-batch", "microbatches-match-batch", "interleaved-microbatches-divisible",
                               "pp-2bw-microbatches"})


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


def evaluate(model: ModelConfig, layout: Layout, work: Workload, cluster: Cluster, *,
             with_cost: bool = True) -> Evaluation:
    """Rules, then memory, then (if it fits, or ``with_cost``) predicted cost."""
    ev = _memory_only(model, layout, work, cluster)
    if ev.rule is not None:
        return ev
    if with_cost or ev.fits:
        ev.cost = step_cost(model, layout, work, cluster)
    ev.note = runtime_note(model, layout, work)
    return ev


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


def _finish(ev: Evaluation, model: ModelConfig, work: Workload, cluster: Cluster) -> Evaluation:
    """Attach the predicted cost (unless computed) and the runtime note to a chosen evaluation."""
    if ev.rule is None:
        if ev.cost is None:
            ev.cost = step_cost(model, ev.layout, work, cluster)
        ev.note = runtime_note(model, ev.layout, work)
    return ev


def rank_key(ev: Evaluation) -> tuple[float, int, int, float]:
    """Order of fitting evaluations: step time, then (on a tie to :data:`TIE_DIGITS`) the simpler
    layout, as a user would pick it (fewer axes besides data parallelism, then more of the
    world in data parallelism: dp4 cp2 before dp1 cp8), then memory."""
    assert ev.cost is not None and ev.memory is not None
    L = ev.layout
    others = (L.tp, L.pp, L.cp)
    return float(f"{ev.cost.step_time_s:.{TIE_DIGITS}g}"), sum(d > 1 for d in others), L.tp * L.pp * L.cp, ev.memory.total


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorisations(world: int) -> Iterable[tuple[int, int, int, int]]:
    """Every ``(dp, tp, pp, cp)`` with product ``world``."""
    for tp in divisors(world):
        for pp in divisors(world // tp):
            for cp in divisors(world // (tp * pp)):
                yield world // (tp * pp * cp), tp, pp, cp


def expert_degrees(model: ModelConfig, dp: int, cp: int) -> list[int]:
    """The ep values to try with ``dp`` x ``cp``: the divisors of dp x cp that divide the
    number of experts (rule ``ep-carved-from-dp-cp``); just 1 for a dense model."""
    return [e for e in divisors(dp * cp) if model.n_experts % e == 0] if model.n_experts else [1]


def schedules(model: ModelConfig, pp: int, microbatches: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) to try: 1F1B, ZB-H1, interleaved with V = 2 and 4 (wherever every
    chunk gets a layer: the partition need not be even, its imbalance is priced)."""
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1), ("zb-h1", 1)]
    for v in (2, 4):
        if model.n_layers >= pp * v and microbatches % pp == 0:
            out.append(("interleaved", v))
    return out


def _candidates(model: ModelConfig, partial: dict[str, object], work: Workload,
                cluster: Cluster) -> list[dict[str, object]]:
    """The fixed fields (axes, micro-batch, schedule, virtual stages) :func:`complete` tries."""
    world = cluster.world_size
    base = {k: partial[k] for k in ("tp", "pp", "cp") if k in partial}
    tp, pp, cp = (int(base.get(k, 1)) for k in ("tp", "pp", "cp"))  # type: ignore[call-overload]
    dp = int(partial.get("dp", max(1, world // (tp * pp * cp))))  # type: ignore[call-overload]
    mbs = [partial["micro_batch"]] if "micro_batch" in partial else [
        b for b in MICRO_BATCHES if work.global_batch % (dp * b) == 0] or [1]
    eps = [int(partial["ep"])] if "ep" in partial else expert_degrees(model, dp, cp)  # type: ignore[call-overload]
    out = []
    for ep, mb in ((e, b) for e in eps for b in mbs):
        m = work.global_batch // (dp * int(mb))  # type: ignore[call-overload]
        cp_mode = cp_fields(model, dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch=mb), partial, work, cluster)
        scheds = schedules(model, pp, m)
        if "pipeline_schedule" in partial:
            v = int(partial.get("virtual_stages", 2 if partial["pipeline_schedule"] == "interleaved" else 1))  # type: ignore[call-overload]
            scheds = [(str(partial["pipeline_schedule"]), v)]
        elif "virtual_stages" in partial:
            scheds = [(s, v) for s, v in scheds if v == partial["virtual_stages"]] or [
                ("interleaved", int(partial["virtual_stages"]))]  # type: ignore[call-overload]
        for sched, v in scheds:
            out.append(dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch=mb, pipeline_schedule=sched,
                            virtual_stages=v, **cp_mode))
    return out


def complete(model: ModelConfig, partial: dict[str, object], work: Workload,
             cluster: Cluster) -> tuple[Evaluation, list[Evaluation]]:
    """The best layout agreeing with ``partial`` (``parallel.*`` names + micro_batch); missing
    axes default to 1 except dp, which takes up the rest of the world. Returns the best and
    every evaluation tried (for explanations), each with its predicted cost."""
    tried = [_cheapest_fit(model, partial, fixed, work, cluster)
             for fixed in _candidates(model, partial, work, cluster)]
    fitting = [e for e in tried if e.fits and e.cost is not None]
    if fitting:
        return min(fitting, key=rank_key), tried
    ranked = sorted(tried, key=lambda e: (e.rule is not None, e.shortfall_gib))
    return ranked[0], tried


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
    rule = layout_rule(model, next(iter(layouts.values())), work)  # the same for all of them
    smallest: Evaluation | None = None
    for rec in levels:
        done: dict[object, Evaluation] = {}
        order = list(zeros)
        if order == list(ZERO):
            # ZeRO-1 holds less than ZeRO-0 (equal at dp x cp = 1: ZeRO shards over both), and
            # ZeRO-2 less than ZeRO-1 with one micro-batch per step but more with accumulation
            # (the full gradients plus their shard): if the least of them does not fit, neither
            # do the others
            least = [0] if int(fixed["dp"]) * int(fixed["cp"]) == 1 else [1, 2]  # type: ignore[call-overload]
            for z in least:
                done[z] = _memory_only(model, layouts[(rec, z)], work, cluster, rule=rule)
            if all(done[z].rule is None and not done[z].fits for z in least):
                order = [*least, 3]
        fits = []
        for z in order:
            ev = done[z] if z in done else _memory_only(model, layouts[(rec, z)], work, cluster, rule=rule)
            if ev.rule is not None:
                return [], ev
            if ev.fits:
                fits.append(ev)
            if smallest is None or ev.shortfall_gib < smallest.shortfall_gib:
                smallest = ev
        if fits:
            return fits, fits[0]
    assert smallest is not None
    if not any(k in partial for k in ("offload_optimizer", "offload_to", "offload_params", "zero_stage")):
        # nothing fits on the device: offload ZeRO-3's optimizer state, then its parameter shards,
        # to host memory, and where the host cannot hold them either, to disk (ZeRO-Infinity);
        # activations stay on the device there (host memory is what those offloads compete for)
        base = next((lv for lv in reversed(levels) if not lv[1]), levels[-1])
        for where, params in OFFLOAD_LADDER:
            ev = _memory_only(model, dataclasses.replace(layouts[(base, 3)], offload_optimizer=True,
                                                         offload_to=where, offload_params=params),  # type: ignore[arg-type]
                              work, cluster, rule=rule)
            if ev.fits:
                return [ev], ev
    return [], smallest


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


def _cheapest_fit(model: ModelConfig, partial: dict[str, object], fixed: dict[str, object],
                  work: Workload, cluster: Cluster) -> Evaluation:
    """Given the axes, micro-batch and schedule: among the ZeRO stages that fit at the cheapest
    recompute level, the fastest (less memory on a tie); if none fits, the smallest one."""
    fits, smallest = _with_hsdp(model, partial, work, cluster, *_fitting_options(model, partial, fixed, work, cluster))
    if not fits:
        return _finish(smallest, model, work, cluster)
    for ev in fits:
        ev.cost = step_cost(model, ev.layout, work, cluster)
    return _finish(min(fits, key=rank_key), model, work, cluster)


def _with_hsdp(model: ModelConfig, partial: dict[str, object], work: Workload, cluster: Cluster,
               fits: list[Evaluation], smallest: Evaluation) -> tuple[list[Evaluation], Evaluation]:
    """:func:`_fitting_options`' answer with the fitting ZeRO options' hybrid-sharded variants
    added (:func:`with_shard_groups`), unless ``partial`` fixes ``dp_shard``."""
    if "dp_shard" in partial or not fits:
        return fits, smallest
    return with_shard_groups(fits, lambda lay: _memory_only(model, lay, work, cluster, rule=fits[0].broken),
                             cluster.gpus_per_node), smallest


Option = tuple[float, int, Evaluation]  # (lower bound of the step time, order tried, evaluation)


def _options(model: ModelConfig, partial: dict[str, object], work: Workload,
             cluster: Cluster) -> tuple[list[Option], list[Evaluation]]:
    """Every fitting option of :func:`complete` with its step-time lower bound (no simulation),
    and, per candidate where nothing fits, its smallest (or rule-breaking) evaluation."""
    options: list[Option] = []
    misses: list[Evaluation] = []
    for fixed in _candidates(model, partial, work, cluster):
        fits, smallest = _with_hsdp(model, partial, work, cluster, *_fitting_options(model, partial, fixed, work, cluster))
        if not fits:
            misses.append(smallest)
        for ev in fits:
            bound = step_cost(model, ev.layout, work, cluster, bound_only=True).step_time_s
            options.append((bound, len(options), ev))
    return options, misses


def _closest_miss(misses: list[Evaluation]) -> Evaluation:
    return min(misses, key=lambda e: (e.rule is not None, e.shortfall_gib))


def best_for_axes(model: ModelConfig, partial: dict[str, object], work: Workload,
                  cluster: Cluster) -> Evaluation:
    """``complete(...)[0]`` without the explanations, pruned: every fitting option gets the
    closed-form lower bound of its step time first, and the schedule is simulated only while a
    bound could still reach (or tie) the best step time found, in increasing bound order."""
    options, misses = _options(model, partial, work, cluster)
    if not options:
        return _finish(_closest_miss(misses), model, work, cluster)
    best: tuple[tuple[float, float], int, Evaluation] | None = None
    for bound, order, ev in sorted(options, key=lambda o: (o[0], o[1])):
        if best is not None and bound > best[2].cost.step_time_s * (1 + PRUNE_MARGIN):  # type: ignore[union-attr]
            break
        ev.cost = step_cost(model, ev.layout, work, cluster)
        if best is None or (rank_key(ev), order) < (best[0], best[1]):
            best = (rank_key(ev), order, ev)
    assert best is not None
    return _finish(best[2], model, work, cluster)


@dataclass
class SearchResult:
    """Fitting layouts ranked by step time, and what was rejected and why. With ``top`` given to
    :func:`search`, ``ranked`` holds only the ``top`` best (exactly those of a full search) and
    ``unranked`` the other factorisations that fit, not completed (one fitting layout each,
    memory only: their best step time was not needed)."""

    ranked: list[Evaluation]
    rejected_rules: dict[str, list[Layout]] = field(default_factory=dict)
    too_big: list[Evaluation] = field(default_factory=list)
    unranked: list[Evaluation] = field(default_factory=list)
    unbuilt: Evaluation | None = None  # the best layout set aside as unbuilt (search's runnable_top)

    def smallest_shortfall(self) -> Evaluation | None:
        return min(self.too_big, key=lambda e: e.shortfall_gib, default=None)

    @property
    def fitting(self) -> int:
        """How many factorisations have a layout that fits."""
        return len(self.ranked) + len(self.unranked)


def search(model: ModelConfig, work: Workload, cluster: Cluster, *,
           runnable_only: bool = False, top: int | None = None, runnable_top: bool = False) -> SearchResult:
    """Every factorisation of the cluster, completed and ranked (fastest first, then smallest).
    ``top``: only the ``top`` best need completing (with their costs); the other fitting
    factorisations stay in ``unranked`` and the misses in ``too_big`` without costs (the
    simulations that would take the time are skipped; :func:`with_cost` adds one). Ignored with
    ``runnable_only``. ``runnable_top`` (with ``top``): rank only options this version's trainer
    runs, and keep the best of the others in ``unbuilt`` (:func:`_set_aside_unbuilt`)."""
    result = SearchResult([])
    top = None if top is None else max(1, top)
    found: list[tuple[list[Option], list[Evaluation]]] = []
    for dp, tp, pp, cp, ep in ((*f, e) for f in factorisations(cluster.world_size)
                               for e in expert_degrees(model, f[0], f[3])):
        axes = dict(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
        probe = Layout(**axes, micro_batch=max(1, min(
            b for b in MICRO_BATCHES if work.global_batch % (dp * b) == 0) if work.global_batch % dp == 0 else 1))
        broken = layout_rule(model, probe, work)
        if broken is not None and (work.global_batch % dp != 0 or broken.rule.name not in MICRO_BATCH_RULES):
            result.rejected_rules.setdefault(broken.reason, []).append(probe)
            continue
        if top is None or runnable_only:
            best = best_for_axes(model, axes, work, cluster)
            if best.reason is not None:
                result.rejected_rules.setdefault(best.reason, []).append(best.layout)
            elif best.fits and not (runnable_only and best.note):
                result.ranked.append(best)
            elif not best.fits:
                result.too_big.append(best)
            continue
        options, misses = _options(model, axes, work, cluster)
        if options:
            found.append((options, misses))
            continue
        miss = _closest_miss(misses)
        if miss.reason is not None:
            result.rejected_rules.setdefault(miss.reason, []).append(miss.layout)
        else:
            result.too_big.append(miss)
    if top is None or runnable_only:
        result.ranked.sort(key=rank_key)
        return result
    if runnable_top:
        found, result.unbuilt = _set_aside_unbuilt(found, model, work, cluster)
    _top_ranked(result, found, top, model, work, cluster)
    return result


def _set_aside_unbuilt(found: list[tuple[list[Option], list[Evaluation]]], model: ModelConfig, work: Workload,
                       cluster: Cluster) -> tuple[list[tuple[list[Option], list[Evaluation]]], Evaluation | None]:
    """``found`` with only the options the trainer runs (no runtime note; a factorisation left
    with none drops out), and the fastest of the options set aside, with its cost and note
    (branch and bound on the options' lower bounds, as :func:`best_for_axes`)."""
    kept: list[tuple[list[Option], list[Evaluation]]] = []
    aside: list[Option] = []
    for options, misses in found:
        notes = [runtime_note(model, o[2].layout, work) for o in options]
        runs = [o for o, note in zip(options, notes, strict=True) if note is None]
        aside += [o for o, note in zip(options, notes, strict=True) if note is not None]
        if runs:
            kept.append((runs, misses))
    best: Evaluation | None = None
    for bound, _, ev in sorted(aside, key=lambda o: (o[0], o[1])):
        if best is not None and bound > best.cost.step_time_s * (1 + PRUNE_MARGIN):  # type: ignore[union-attr]
            break
        ev.cost = step_cost(model, ev.layout, work, cluster)
        if best is None or rank_key(ev) < rank_key(best):
            best = ev
    return kept, None if best is None else _finish(best, model, work, cluster)


def with_cost(ev: Evaluation, model: ModelConfig, work: Workload, cluster: Cluster) -> Evaluation:
    """``ev`` with its predicted cost and runtime note (for entries :func:`search` with ``top``
    left without: ``unranked`` and ``too_big``)."""
    return _finish(ev, model, work, cluster)


def _top_ranked(result: SearchResult, found: list[tuple[list[Option], list[Evaluation]]], top: int,
                model: ModelConfig, work: Workload, cluster: Cluster) -> None:
    """Branch and bound over every factorisation's options at once, in increasing bound order:
    stop when a bound exceeds the ``top``-th best step time among the factorisations' bests so
    far (those only improve, so nothing left could enter the top). Fills ``result.ranked`` with
    the top factorisations' bests (ties by factorisation order, as a full search sorts) and
    ``result.unranked`` with one fitting evaluation of each other factorisation."""
    pending = sorted(((bound, i, order, ev) for i, (opts, _) in enumerate(found) for bound, order, ev in opts),
                     key=lambda o: o[:3])
    best: dict[int, tuple[tuple[float, float], int, Evaluation]] = {}
    for bound, i, order, ev in pending:
        times = sorted(b[2].cost.step_time_s for b in best.values())  # type: ignore[union-attr]
        if len(times) >= top and bound > times[top - 1] * (1 + PRUNE_MARGIN):
            break
        ev.cost = step_cost(model, ev.layout, work, cluster)
        if i not in best or (rank_key(ev), order) < best[i][:2]:
            best[i] = (rank_key(ev), order, ev)
    order_of = sorted(best, key=lambda i: (best[i][0], i))[:top]
    result.ranked = [_finish(best[i][2], model, work, cluster) for i in order_of]
    chosen = set(order_of)
    result.unranked = [min(opts, key=lambda o: (o[0], o[1]))[2] for i, (opts, _) in enumerate(found)
                       if i not in chosen]
    for ev in result.unranked:
        ev.cost = None


def with_shard_groups(fits: list[Evaluation], evaluate: Callable[[Layout], Evaluation], gpus_per_node: int) -> list[Evaluation]:
    """``fits`` (evaluations of fitting layouts) and, for each ZeRO one, its hybrid-sharded
    variants (:func:`shard_sizes`) that fit too: the search then ranks them by step time like
    any other option (``evaluate``: the memory-only evaluation of a layout)."""
    out = list(fits)
    for ev in fits:
        for d in shard_sizes(ev.layout, gpus_per_node):
            other = evaluate(dataclasses.replace(ev.layout, dp_shard=d))
            if other.rule is None and other.fits:
                out.append(other)
    return out
