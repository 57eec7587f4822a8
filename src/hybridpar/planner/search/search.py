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

Speed (``benchmarks/planner_search.py``; ``hybridpar plan`` imports no torch): memory before time,
cached per shape, only the pipeline ranks that can be the worst, and a pipeline layout whose one
rank already exceeds the GPU not priced further (:mod:`hybridpar.planner.search.fitting`); a
layer priced once per set of the fields it reads (:func:`~hybridpar.planner.price.cost.priced_layer`,
:func:`~hybridpar.planner.memory.activations.layer_activation_bytes`); the schedule simulated only
where the lower bound (the busiest rank's compute) can still win; a layout's stage scales and
pipeline span shared by the options that differ only in ZeRO, offload and hybrid sharding; a
hybrid-sharded variant whose one rank already exceeds the GPU not evaluated; the runtime notes
read only for the options the ranking reaches (:class:`_Notes`). Pruning never changes the answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from hybridpar.config import ModelConfig
from hybridpar.planner.machine.hardware import Cluster
from hybridpar.planner.memory.plan import memory_bound
from hybridpar.planner.model.hsdp import shard_sizes
from hybridpar.planner.model.layout import Layout, Workload, layout_rule, runtime_note
from hybridpar.planner.price.cost import step_cost
from hybridpar.planner.search.cp_modes import cp_fields
from hybridpar.planner.search.fitting import OFFLOAD_FRACTIONS as OFFLOAD_FRACTIONS
from hybridpar.planner.search.fitting import OFFLOAD_LADDER as OFFLOAD_LADDER
from hybridpar.planner.search.fitting import RECOMPUTE as RECOMPUTE
from hybridpar.planner.search.fitting import ZERO as ZERO
from hybridpar.planner.search.fitting import Evaluation as Evaluation
from hybridpar.planner.search.fitting import Level as Level
from hybridpar.planner.search.fitting import _fitting_options as _fitting_options
from hybridpar.planner.search.fitting import _memory_only as _memory_only
from hybridpar.planner.search.fitting import memory_levels as memory_levels

MICRO_BATCHES = (1, 2, 4, 8)
TIE_DIGITS = 9  # step times equal to this many significant digits tie; memory decides
PRUNE_MARGIN = 1e-7  # a bound this far (relative) above the best may still tie after rounding
# the rules (by name) that another micro-batch size may mend: a factorisation whose probe breaks
# one of them is completed anyway (its other micro-batch sizes are tried)
MICRO_BATCH_RULES = frozenset({"dp-divides-batch", "microbatches-match-batch", "interleaved-microbatches-divisible",
                               "pp-2bw-microbatches"})


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
    def shard(lay: Layout, base: Evaluation) -> Evaluation | None:
        # a pipeline layout whose one rank (the worst of the unsharded one, as a hint) already
        # exceeds the GPU does not fit: not evaluated further (with_shard_groups keeps what fits)
        assert base.memory is not None
        bound = memory_bound(model, lay, work, base.memory.worst_rank)
        if bound is not None and bound > cluster.gpu.usable_bytes:
            return None
        return _memory_only(model, lay, work, cluster, rule=fits[0].broken)
    return with_shard_groups(fits, shard, cluster.gpus_per_node), smallest


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
    runs: Callable[[Evaluation], bool] | None = None
    if runnable_top:
        note = _Notes(model, work)
        result.unbuilt = _best_unbuilt(found, note, model, work, cluster)
        runs = note.runs
    _top_ranked(result, found, top, model, work, cluster, runs)
    return result


class _Notes:
    """Each option's runtime note (:func:`runtime_note`), computed at most once and only when the
    ranking asks for it: the search's branch and bound reads the notes of the options it reaches,
    and of each factorisation's options up to its first runnable one, not of all of them."""

    def __init__(self, model: ModelConfig, work: Workload) -> None:
        self.model, self.work = model, work
        self.got: dict[int, tuple[Evaluation, str | None]] = {}  # by id, the evaluation kept alive

    def __call__(self, ev: Evaluation) -> str | None:
        hit = self.got.get(id(ev))
        if hit is None:
            hit = self.got[id(ev)] = (ev, runtime_note(self.model, ev.layout, self.work))
        return hit[1]

    def runs(self, ev: Evaluation) -> bool:
        """Whether this version's trainer runs the option (no note)."""
        return self(ev) is None


def _best_unbuilt(found: list[tuple[list[Option], list[Evaluation]]], note: _Notes, model: ModelConfig,
                  work: Workload, cluster: Cluster) -> Evaluation | None:
    """The fastest of the options set aside (those with a runtime note), with its cost and note:
    branch and bound on the options' lower bounds, as :func:`best_for_axes`, in the order of
    bound, then order tried, then factorisation (the notes read lazily, in that order)."""
    best: Evaluation | None = None
    for bound, _, _, ev in sorted((o[0], o[1], i, o[2]) for i, (opts, _) in enumerate(found) for o in opts):
        if best is not None and bound > best.cost.step_time_s * (1 + PRUNE_MARGIN):  # type: ignore[union-attr]
            break
        if note(ev) is None:
            continue
        ev.cost = step_cost(model, ev.layout, work, cluster)
        if best is None or rank_key(ev) < rank_key(best):
            best = ev
    return None if best is None else _finish(best, model, work, cluster)


def with_cost(ev: Evaluation, model: ModelConfig, work: Workload, cluster: Cluster) -> Evaluation:
    """``ev`` with its predicted cost and runtime note (for entries :func:`search` with ``top``
    left without: ``unranked`` and ``too_big``)."""
    return _finish(ev, model, work, cluster)


def _top_ranked(result: SearchResult, found: list[tuple[list[Option], list[Evaluation]]], top: int,
                model: ModelConfig, work: Workload, cluster: Cluster,
                runs: Callable[[Evaluation], bool] | None = None) -> None:
    """Branch and bound over every factorisation's options at once, in increasing bound order:
    stop when a bound exceeds the ``top``-th best step time among the factorisations' bests so
    far (those only improve, so nothing left could enter the top). Fills ``result.ranked`` with
    the top factorisations' bests (ties by factorisation order, as a full search sorts) and
    ``result.unranked`` with one fitting evaluation of each other factorisation: its option of
    least bound. ``runs``: rank only the options it accepts (a factorisation with none drops out)."""
    ok = runs or (lambda ev: True)
    pending = sorted(((bound, i, order, ev) for i, (opts, _) in enumerate(found) for bound, order, ev in opts),
                     key=lambda o: o[:3])
    best: dict[int, tuple[tuple[float, float], int, Evaluation]] = {}
    times: list[float] = []
    for bound, i, order, ev in pending:
        if len(times) >= top and bound > times[top - 1] * (1 + PRUNE_MARGIN):
            break
        if not ok(ev):
            continue
        ev.cost = step_cost(model, ev.layout, work, cluster)
        if i not in best or (rank_key(ev), order) < best[i][:2]:
            best[i] = (rank_key(ev), order, ev)
            times = sorted(b[2].cost.step_time_s for b in best.values())  # type: ignore[union-attr]
    order_of = sorted(best, key=lambda i: (best[i][0], i))[:top]
    result.ranked = [_finish(best[i][2], model, work, cluster) for i in order_of]
    chosen = set(order_of)
    firsts = (next((o[2] for o in sorted(opts, key=lambda o: (o[0], o[1])) if ok(o[2])), None)
              for i, (opts, _) in enumerate(found) if i not in chosen)
    result.unranked = [ev for ev in firsts if ev is not None]
    for ev in result.unranked:
        ev.cost = None


def with_shard_groups(fits: list[Evaluation], evaluate: Callable[[Layout, Evaluation], Evaluation | None],
                      gpus_per_node: int) -> list[Evaluation]:
    """``fits`` (evaluations of fitting layouts) and, for each ZeRO one, its hybrid-sharded
    variants (:func:`shard_sizes`) that fit too: the search then ranks them by step time like
    any other option (``evaluate(layout, unsharded)``: the memory-only evaluation of a layout,
    or None where it is known not to fit)."""
    out = list(fits)
    for ev in fits:
        for d in shard_sizes(ev.layout, gpus_per_node):
            other = evaluate(dataclasses.replace(ev.layout, dp_shard=d), ev)
            if other is not None and other.rule is None and other.fits:
                out.append(other)
    return out
