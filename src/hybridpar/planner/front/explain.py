"""What ``hybridpar plan`` says about a layout: the ranked table's rows, and why the best layout
won: its pipeline schedule, cp mode, activation offload, HSDP group and expert-parallel degree
against the alternatives, each priced by the same memory and cost models the search used."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from collections.abc import Callable

from hybridpar.config import ModelConfig
from hybridpar.parallel.offload_count import offloaded_count
from hybridpar.planner.errors import PlanError
from hybridpar.planner.machine.hardware import Cluster
from hybridpar.planner.memory.offload import layer_offload_bytes
from hybridpar.planner.memory.plan import COMPONENTS, plan_memory
from hybridpar.planner.model.hsdp import hsdp, shard_sizes, zero_group
from hybridpar.planner.model.layout import Layout, Workload, model_key
from hybridpar.planner.model.moe import DEFAULT_IMBALANCE, imbalance_from_run, rank_load
from hybridpar.planner.model.shapes import layer_partition, v_shaped
from hybridpar.planner.price.cost import step_cost
from hybridpar.planner.price.cp import cp_bytes
from hybridpar.planner.search.cp_modes import describe, layer_seconds, modes
from hybridpar.planner.search.search import (
    Evaluation,
    SearchResult,
    complete,
    evaluate,
    expert_degrees,
    schedules,
)


def moe_imbalance(args: argparse.Namespace) -> tuple[float, str]:
    """The routing imbalance to plan for and where it came from (``--moe-imbalance``,
    ``--from-run`` or the default)."""
    if args.from_run:
        return imbalance_from_run(args.from_run[0])
    if args.moe_imbalance is not None:
        if not args.moe_imbalance >= 1.0:
            raise PlanError(f"--moe-imbalance {args.moe_imbalance} must be >= 1 (max/mean tokens per expert; "
                            "1 = perfectly balanced)")
        return args.moe_imbalance, "--moe-imbalance"
    return DEFAULT_IMBALANCE, "default (Switch Transformer's capacity factor)"


def _headroom(cluster: Cluster) -> str:
    """How the capacity a plan fills is less than the device's memory, when it is."""
    g = cluster.gpu
    if not g.headroom_bytes:
        return ""
    return (f"; {g.usable_bytes / 2**30:.1f} GiB = the {g.hbm_bytes / 2**30:.1f} GiB CUDA has less "
            f"{g.headroom_bytes / 2**30:.1f} GiB ({g.headroom_bytes / g.hbm_bytes:.0%}) kept free for the CUDA "
            "context, NCCL buffers and fragmentation")


def _tflops(rate: float) -> str:
    """A TFLOP/s rate with three significant digits: a CPU's 0.0021 is not shown as 0.0."""
    return f"{rate:.1f}" if rate >= 100 else f"{rate:.3g}"


def table_row(ev: Evaluation, moe: bool = False) -> str:
    """One ranked layout as a row under :func:`header`."""
    L, c, m = ev.layout, ev.cost, ev.memory
    extra = f"{L.pipeline_schedule}{'x' + str(L.virtual_stages) if L.virtual_stages > 1 else ''}" if L.pp > 1 else "-"
    mem = f"{m.total / 2**30:7.1f}" if m else "      -"
    rate = (f"{c.step_time_s:8.3f} {100 * c.mfu:5.1f}% {_tflops(c.tflops_per_gpu):>7} {c.tokens_per_s:11,.0f}"
            if c else "")
    ep = f" {L.ep:>3}" if moe else ""
    offload = (f"{L.offload_to}{'+p' if L.offload_params else ''}" if L.offload_optimizer else "-")
    rec = L.recompute + (("+ao" + (f"{round(100 * L.offload_activations_fraction)}"  # activation offload
                                    if L.offload_activations_fraction < 1 else "")) if L.offload_activations else "")
    return (f"{L.dp:>4} {L.tp:>3} {L.pp:>3} {L.cp:>3}{ep} {L.micro_batch:>3} {L.zero_stage:>4} {offload:>7} "
            f"{rec:>9} {'y' if L.sequence_parallel else 'n':>2} {extra:>13} {mem} {rate}")


def header(moe: bool = False) -> str:
    """The table's column names (an ``ep`` column for mixture-of-experts models)."""
    ep = f" {'ep':>3}" if moe else ""
    return (f"{'dp':>4} {'tp':>3} {'pp':>3} {'cp':>3}{ep} {'mb':>3} {'zero':>4} {'offload':>7} {'recompute':>9} "
            f"{'sp':>2} {'schedule':>13} {'mem GiB':>7} {'step s':>8} {'MFU':>6} {'TFLOP/s':>7} {'tokens/s':>11}")


def explain(ev: Evaluation, moe: bool = False) -> str:
    """Every term of one evaluation, for ``--layout``."""
    lines = [header(moe), table_row(ev, moe), ""]
    if ev.rule:
        return "\n".join(lines + [f"rejected: {ev.rule}"])
    m, c = ev.memory, ev.cost
    assert m is not None
    lines.append(f"memory of the worst pipeline rank ({m.worst_rank}; {m.in_flight} micro-batch chunks in flight):")
    for k in COMPONENTS:
        lines.append(f"  {k:<13} {m.components[k] / 2**30:9.2f} GiB")
    lines.append(f"  {'total':<13} {m.total / 2**30:9.2f} GiB of {ev.capacity / 2**30:.1f} GiB"
                 + ("" if ev.fits else f"  -> does not fit by {ev.shortfall_gib:.2f} GiB"))
    if m.cpu_bytes:
        lines.append(f"  host (offloaded state) {m.cpu_bytes / 2**30:.2f} GiB")
    if m.disk_bytes:
        lines.append(f"  disk (offloaded state, in files) {m.disk_bytes / 2**30:.2f} GiB")
    if c is not None:
        lines.append("time per step:")
        for k, v in c.terms.items():
            lines.append(f"  {k:<20} {v:10.4f} s")
        lines.append(f"  step time {c.step_time_s:.3f} s, MFU {100 * c.mfu:.1f}%, {_tflops(c.tflops_per_gpu)} model "
                     f"TFLOP/s per GPU ({_tflops(c.hw_tflops_per_gpu)} with recompute), bubble "
                     f"{100 * c.bubble_fraction:.1f}%, {c.tokens_per_s:,.0f} tokens/s")
    if ev.note:
        lines.append(f"note: this version's trainer cannot run it yet: {ev.note}")
    return "\n".join(lines)


def _named(L: Layout) -> str:
    """``dp=8,tp=1,pp=4,cp=1 zb-h1``: a layout's axes and, with a pipeline, its schedule; without
    one, ``(no pipeline)`` (its schedule field names nothing that runs)."""
    return f"{L.short()} {_schedule(L) if L.pp > 1 else '(no pipeline)'}"


def _schedule(L: Layout) -> str:
    """``zb-h1``, ``interleaved x4``: a layout's schedule as the explanations name it."""
    return L.pipeline_schedule + (f" x{L.virtual_stages}" if L.virtual_stages > 1 else "")


def _runs(counts: list[int]) -> str:
    """``[2, 2, 2, 1, 1]`` -> ``"2 x3, 1 x2"`` (run lengths, in order)."""
    return ", ".join(f"{k} x{len(list(g))}" for k, g in itertools.groupby(counts))


def pipeline_reasons(model: ModelConfig, ev: Evaluation, work: Workload, cluster: Cluster) -> list[str]:
    """How layout ``ev``'s pipeline stages split the layers, and what the other schedules would
    take on the same axes (nothing without pp)."""
    L, c = ev.layout, ev.cost
    if L.pp == 1 or c is None:
        return []
    part = layer_partition(model_key(model), L.pp, L.virtual_stages, v_shaped(L.pipeline_schedule))
    counts = [len(ch.layers) for ch in part.chunks]
    even = "" if model.n_layers % len(counts) == 0 else f" ({model.n_layers} does not divide by {len(counts)})"
    lines = [f"stages: {model.n_layers} layers in {len(counts)} chunks{even}, balanced by matmul FLOPs with the "
             f"embedding first and the head last: layers per chunk {_runs(counts)}; the heaviest chunk is "
             f"{part.imbalance:.2f}x the mean"]
    alts = []
    for sched, v in schedules(model, L.pp, L.microbatches(work.global_batch)):
        if (sched, v) == (L.pipeline_schedule, L.virtual_stages):
            continue
        other = evaluate(model, dataclasses.replace(L, pipeline_schedule=sched, virtual_stages=v), work, cluster)
        if other.rule is None and other.cost is not None:
            alts.append(f"{_schedule(other.layout)} {other.cost.step_time_s:.3f} s (bubble "
                        f"{100 * other.cost.bubble_fraction:.1f}%{'' if other.fits else ', does not fit'})")
    lines.append(f"schedule: {_schedule(L)}, bubble {100 * c.bubble_fraction:.1f}% of the step"
                 + (f"; on the same axes {'; '.join(alts)}" if alts else ""))
    return lines


def why(model: ModelConfig, result: SearchResult, work: Workload, cluster: Cluster) -> list[str]:
    """Why the best layout is first: its margin over the next, its memory, how the pipeline
    stages split the layers, and what the other schedules would take on the same axes."""
    best = result.ranked[0]
    L, c, m = best.layout, best.cost, best.memory
    assert c is not None and m is not None
    lines = [f"fastest of {result.fitting} fitting layouts: {c.step_time_s:.3f} s per step"]
    if len(result.ranked) > 1 and result.ranked[1].cost is not None:
        nxt = result.ranked[1]
        lines[0] += (f"; the next, {_named(nxt.layout)}, {nxt.cost.step_time_s:.3f} s "
                     f"(+{100 * (nxt.cost.step_time_s / c.step_time_s - 1):.1f}%)")
    lines.append(f"memory {m.total / 2**30:.1f} of {best.capacity / 2**30:.1f} GiB on the worst pipeline rank "
                 f"(ZeRO-{L.zero_stage}, recompute {L.recompute}){_headroom(cluster)}")
    lines.append(dp_shard_reason(best, lambda lay: evaluate(model, lay, work, cluster), cluster.gpus_per_node))
    lines += pipeline_reasons(model, best, work, cluster)
    lines += cp_reason(model, L, work, cluster)
    reason = offload_reason(model, L, work, cluster, best.capacity)
    lines += [reason] if reason else []
    return [f"why {_named(L)}: {lines[0]}", *(f"  {x}" for x in lines[1:])]


def unbuilt_line(ev: Evaluation, gain: float) -> str:
    """The best layout set aside as unbuilt, its predicted step time and gain, and why."""
    assert ev.cost is not None
    faster = f", {100 * gain:.1f}% faster than the best above" if gain > 0 else ""
    return (f"not ranked: {_named(ev.layout)} (ZeRO-{ev.layout.zero_stage}) would take {ev.cost.step_time_s:.3f} s "
            f"per step{faster}, but this version's trainer cannot run it: {ev.note}")


def unbuilt_gain(result: SearchResult) -> tuple[Evaluation, float] | None:
    """The best layout the search set aside as unbuilt and how much faster it would be than the
    best that runs (``0.1``: 10% less step time), when it is faster (or nothing runs)."""
    ev = result.unbuilt
    if ev is None or ev.cost is None or not ev.fits:
        return None
    if not result.ranked:
        return ev, 0.0
    best = result.ranked[0].cost
    assert best is not None
    gain = 1 - ev.cost.step_time_s / best.step_time_s
    return (ev, gain) if gain > 0 else None


def explain_ep(model: ModelConfig, best: Evaluation, work: Workload, cluster: Cluster, imbalance: float,
               source: str) -> str:
    """Why this ep: the best layout's axes completed at every other expert-parallel degree, with
    memory, step time and the all-to-all and expert-compute terms that decide between them."""
    L = best.layout
    lines = [f"\nexpert parallelism (routing imbalance {imbalance:g} max/mean tokens per expert, {source}; "
             "the slowest ep rank bounds each MoE layer):",
             f"  {'ep':>3} {'experts/rank':>12} {'mem GiB':>8} {'step s':>8} {'all-to-all s':>12}  verdict"]
    for ep in expert_degrees(model, L.dp, L.cp):
        ev = best if ep == L.ep else complete(model, dict(dp=L.dp, tp=L.tp, pp=L.pp, cp=L.cp, ep=ep), work,
                                              cluster)[0]
        c, m = ev.cost, ev.memory
        if ev.rule is not None or c is None or m is None:
            verdict = f"rejected: {ev.rule}" if ev.rule else "not evaluated"
            lines.append(f"  {ep:>3} {model.n_experts // ep:>12} {'-':>8} {'-':>8} {'-':>12}  {verdict}")
            continue
        if ep == L.ep:
            verdict = "chosen"
        elif not ev.fits:
            verdict = f"does not fit (+{ev.shortfall_gib:.1f} GiB)"
        else:
            assert best.cost is not None and best.memory is not None
            dt = c.step_time_s / best.cost.step_time_s
            dm = (m.total - best.memory.total) / 2**30
            verdict = f"{dt:.3f}x the step time, {dm:+.1f} GiB"
        lines.append(f"  {ep:>3} {model.n_experts // ep:>12} {m.total / 2**30:>8.1f} {c.step_time_s:>8.3f} "
                     f"{c.terms.get('ep_all_to_all', 0.0):>12.3f}  {verdict}")
    lines.append(f"  ep={L.ep}: " + _ep_reason(L.ep, model.n_experts, L.dp * L.cp,
                                                rank_load(imbalance, L.ep, model.n_experts)))
    return "\n".join(lines)


def _ep_reason(ep: int, n_experts: int, dp_cp: int, load: float) -> str:
    """One sentence on the trade-off the chosen ep makes."""
    if ep == 1:
        return ("every rank holds all experts and computes its own tokens' slots: no all-to-all and no "
                "imbalance penalty, and the experts' memory fits")
    return (f"each rank holds {n_experts // ep} of {n_experts} experts (expert memory / {ep}; their gradients "
            f"reduce over {dp_cp // ep} rank(s)), paying dispatch/combine all-to-alls and the hottest rank "
            f"computing {load:.3g}x the mean routed rows")


def cp_reason(model: ModelConfig, L: Layout, work: Workload, cluster: Cluster) -> list[str]:
    """One line for ``hybridpar plan``: the chosen mode, its traffic and layer time against the
    other legal modes'."""
    if L.cp == 1:
        return ["cp_mode: none needed, cp = 1 (the fastest layout splits no sequence over ranks)"]
    parts = []
    for c in modes(model, L):
        block, a2a, hops = cp_bytes(model, c, work)
        traffic = 2 * a2a + hops * block * (3 * work.act_bytes + 4)  # sent per layer, forward + backward
        parts.append(f"{describe(c)} {traffic / 2**20:,.0f} MiB {1e3 * layer_seconds(model, c, work, cluster):.2f} ms")
    return [f"cp_mode {describe(L)}: per layer and micro-batch, cp payload and layer time: " + "; ".join(parts)]


def offload_reason(model: ModelConfig, layout: Layout, work: Workload, cluster: Cluster, capacity: float) -> str | None:
    """Why ``layout`` offloads activations, for ``hybridpar plan``: what it takes off the device,
    what it costs, and what the same layout needs without it; for a layout that keeps its
    activations on the device, that it fits without (offload is tried only where no recompute
    level fits). None for a layout that does not fit either way."""
    if not layout.offload_activations:
        mem = plan_memory(model, layout, work)
        return None if mem.total > capacity else (
            f"activation offload: off, activations stay on the device ({mem.total / 2**30:.1f} of "
            f"{capacity / 2**30:.1f} GiB with recompute {layout.recompute}; offload comes in only where no "
            "recompute level fits, before a smaller micro-batch)")

    on = plan_memory(model, layout, work)
    without = dataclasses.replace(layout, offload_activations=False, offload_activations_fraction=1.0)
    off = plan_memory(model, without, work)
    gib = 2**30
    per_chunk = max(1, model.n_layers // (layout.pp * layout.virtual_stages))
    k = offloaded_count(per_chunk, layout.offload_activations_fraction)
    nbytes = layer_offload_bytes(model, layout, work, 0)
    added = step_cost(model, layout, work, cluster).step_time_s - step_cost(model, without, work, cluster).step_time_s
    verdict = (f"without it this layout needs {off.total / gib:.1f} GiB of {capacity / gib:.1f}"
               if off.total > capacity else f"it fits without ({off.total / gib:.1f} GiB)")
    return (f"activation offload: {k} of each chunk's ~{per_chunk} layers keep what they save for backward in host "
            f"memory ({nbytes / gib:.2f} GiB a layer and micro-batch, {nbytes / cluster.rank_gpu.host_bw * 1e3:.1f} ms "
            f"each way over the host link, overlapped with compute: +{added:.3f} s per step); device "
            f"{on.total / gib:.1f} GiB, host {on.cpu_bytes / gib:.1f} GiB; {verdict}")


def _span(L: Layout, d: int, gpus_per_node: int) -> str:
    gpus = d * L.tp
    return f"{gpus} GPUs, inside one node" if gpus <= gpus_per_node else f"{gpus} GPUs on {-(-gpus // gpus_per_node)} nodes"


def dp_shard_reason(ev: Evaluation, evaluate: Callable[[Layout], Evaluation], gpus_per_node: int) -> str:
    """Why the chosen layout ``ev`` has its ``dp_shard``: the step time and memory of the other
    choices on the same layout (``evaluate``: a layout's evaluation with its cost)."""
    L, n = ev.layout, ev.layout.dp * ev.layout.cp
    if L.zero_stage == 0 or n == 1:
        return (f"dp_shard: none (ZeRO-{L.zero_stage} over {n} dp x cp ranks: no optimizer state is sharded, "
                "so there is nothing to split into groups)")
    t = ev.cost.step_time_s

    def versus(d: int) -> str:
        other = evaluate(dataclasses.replace(L, dp_shard=d))
        if other.rule is not None or other.cost is None:
            return f"dp_shard={d or n} breaks a rule"
        fit = "" if other.fits else f", does not fit by {other.shortfall_gib:.1f} GiB"
        return (f"dp_shard={d or n}: {other.cost.step_time_s:.3f} s ({100 * (other.cost.step_time_s / t - 1):+.1f}%), "
                f"{other.memory.total / 2**30:.1f} GiB{fit}")

    mine = f"{ev.memory.total / 2**30:.1f} GiB"
    if hsdp(L):
        _, d, r = zero_group(L)
        return (f"dp_shard={d}: ZeRO-{L.zero_stage} shards in groups of {d} dp x cp ranks ({_span(L, d, gpus_per_node)}: "
                f"reduce-scatters and all-gathers on the group's links), one all-reduce of each 1/{d} shard across "
                f"{r} replicas on the inter-node links; {t:.3f} s, {mine} against "
                + "; ".join(versus(x) for x in [0, *(s for s in shard_sizes(L, gpus_per_node) if s != d)]))
    alts = shard_sizes(L, gpus_per_node)
    if not alts:
        return f"dp_shard={n}: ZeRO-{L.zero_stage} shards over all {n} dp x cp ranks (no smaller group nests)"
    return (f"dp_shard={n}: ZeRO-{L.zero_stage} shards over all {n} dp x cp ranks ({t:.3f} s, {mine}); hybrid "
            "sharding " + "; ".join(versus(x) for x in alts))
