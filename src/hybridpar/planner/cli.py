"""``hybridpar plan``: rank layouts for a model on a cluster, or explain one layout.

Answers in about a second without a GPU: the memory model (:mod:`.memory`), the cost model
(:mod:`.cost`) and the search (:mod:`.search`) do the work; this module parses and prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

from hybridpar.config import MODEL_PRESETS, ModelConfig, model_preset
from hybridpar.planner.cp_modes import cp_reason
from hybridpar.planner.fit import from_run, read_run, training_run
from hybridpar.planner.hardware import GPUS, Cluster, PlanError, gpu_spec
from hybridpar.planner.hsdp import dp_shard_reason
from hybridpar.planner.layout import Layout, Workload, model_key, parse_layout
from hybridpar.planner.memory import COMPONENTS
from hybridpar.planner.moe import DEFAULT_IMBALANCE, imbalance_from_run, rank_load
from hybridpar.planner.offload import offload_reason
from hybridpar.planner.search import (
    Evaluation,
    SearchResult,
    complete,
    evaluate,
    expert_degrees,
    schedules,
    search,
    with_cost,
)
from hybridpar.planner.shapes import layer_partition, v_shaped


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridpar plan",
                                description="Predict memory and step time of parallel layouts and rank them.")
    p.add_argument("--model", help=f"a preset ({', '.join(MODEL_PRESETS)}) or a Hugging Face config.json / model "
                                   "directory (default with --from-run: the run's)")
    p.add_argument("--gpu", default=None, help=f"one of {', '.join(GPUS)}, or a TOML spec file (default H100-SXM)")
    p.add_argument("--gpus", type=int, help="total GPUs (default with --from-run: the run's world size)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    p.add_argument("--seq-len", type=int)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--fp8", default="none", choices=["none", "tensorwise", "rowwise"],
                   help="train.fp8: the blocks' linear GEMMs in FP8 (priced at the GPU's FP8 rate plus scaling)")
    p.add_argument("--fp8-all-gather", action="store_true",
                   help="parallel.fp8_all_gather: ZeRO-3 layouts gather the FP8 linears' weights in FP8 (with --fp8 tensorwise)")
    p.add_argument("--loss-chunk-tokens", type=int, default=Workload.loss_chunk_tokens,
                   help="train.loss_chunk_tokens: the head and loss in chunks of this many tokens (0: unchunked)")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    p.add_argument("--layout", help='evaluate one layout, e.g. "dp=8,tp=8,pp=16,cp=1" (other fields chosen by the planner)')
    moe = p.add_mutually_exclusive_group()
    moe.add_argument("--moe-imbalance", type=float, default=None,
                     help=f"mixture of experts: max/mean tokens per expert to plan for (default {DEFAULT_IMBALANCE})")
    moe.add_argument("--from-run", metavar="DIR", action="append",
                     help="a hybridpar train run directory (repeatable): fit the efficiency model to its measured "
                          "step time, re-plan and say how the prediction for its layout moved; for mixture of "
                          "experts also take the routing imbalance it measured")
    return p


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


def load_model(spec: str) -> ModelConfig:
    """A preset name, or a Hugging Face ``config.json`` (or the directory holding it)."""
    path = Path(spec)
    if path.exists():
        from hybridpar.models.hf import model_config_from_hf

        return model_config_from_hf(path.parent if path.is_file() else path, any_rope=True)
    if spec in MODEL_PRESETS:
        return model_preset(spec)
    raise PlanError(f"--model {spec!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor an existing "
                    "Hugging Face config.json / directory")


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


def _row(ev: Evaluation, moe: bool = False) -> str:
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


HEADER = header()


def explain(ev: Evaluation, moe: bool = False) -> str:
    """Every term of one evaluation, for ``--layout``."""
    lines = [header(moe), _row(ev, moe), ""]
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


def _plan_layout(args: argparse.Namespace, model: ModelConfig, work: Workload, cluster: Cluster,
                 head: dict[str, object], moe_source: tuple[float, str]) -> int:
    """``plan --layout``: that layout completed (micro-batch, schedule) and explained."""
    moe = model.n_experts > 0
    best, tried = complete(model, parse_layout(args.layout), work, cluster)
    if args.json:
        print(json.dumps({**head, "layout": best.to_json(),
                          "alternatives": [e.to_json() for e in tried if e is not best]}, indent=1))
    else:
        print(explain(best, moe))
        if best.cost is not None:
            print(dp_shard_reason(best, lambda lay: evaluate(model, lay, work, cluster), cluster.gpus_per_node))
        print("\n".join(pipeline_reasons(model, best, work, cluster)))
        if best.rule is None and (reason := offload_reason(model, best.layout, work, cluster, best.capacity)):
            print(reason)
        if moe and best.cost is not None:
            print(explain_ep(model, best, work, cluster, *moe_source))
    return 0 if best.fits else 1


def cmd_plan(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    # a training run's directory: fit to it (fills --model, --gpus, ... from it); an MoE run's
    # summary alone: only its routing imbalance (moe_imbalance)
    fitted = from_run(args) if args.from_run and all(map(training_run, args.from_run)) else None
    missing = [f"--{k.replace('_', '-')}" for k in ("model", "gpus", "global_batch", "seq_len") if getattr(args, k) is None]
    if missing:
        raise PlanError(f"hybridpar plan needs {', '.join(missing)} (or --from-run DIR of a training run)")
    model = fitted.runs[0].model if fitted and args.model == fitted.model_name else load_model(args.model)
    cluster = Cluster.of(fitted.gpu if fitted else gpu_spec(args.gpu or "H100-SXM"), args.gpus, args.gpus_per_node)
    moe = model.n_experts > 0
    if args.from_run and fitted is None and not moe:
        read_run(next(d for d in args.from_run if not training_run(d)))  # says what the directory lacks
    imbalance, source = moe_imbalance(args) if moe else (DEFAULT_IMBALANCE, "")
    work = Workload(args.global_batch, args.seq_len, args.precision, moe_imbalance=imbalance,
                    loss_chunk_tokens=args.loss_chunk_tokens, fp8=args.fp8, fp8_all_gather=args.fp8_all_gather)
    if fitted is not None:  # the run's runtime: autocast, its block style and loss chunking
        work = fitted.workload(args.global_batch, args.seq_len, imbalance)
    head: dict[str, object] = {"model": args.model, "gpu": cluster.gpu.name, "gpus": cluster.world_size,
                               "gpus_per_node": cluster.gpus_per_node, "global_batch": work.global_batch,
                               "seq_len": work.seq_len, "fp8": work.fp8, "fp8_all_gather": work.fp8_all_gather}
    if moe:
        head |= {"moe_imbalance": imbalance, "moe_imbalance_source": source}
    if fitted is not None:
        head["from_run"] = fitted.to_json()
        if not args.json:
            print("\n".join(fitted.lines()) + "\n")
    if args.layout:
        return _plan_layout(args, model, work, cluster, head, (imbalance, source))
    result = search(model, work, cluster, top=args.top, runnable_top=True)
    unbuilt = unbuilt_gain(result)
    if args.json:
        doc = {**head, "layouts": [e.to_json() for e in result.ranked[:args.top]],
               "too_big": [with_cost(e, model, work, cluster).to_json()
                           for e in sorted(result.too_big, key=lambda e: e.shortfall_gib)[:args.top]],
               "rejected": {rule: len(ls) for rule, ls in result.rejected_rules.items()}}
        if result.ranked:
            doc["why"] = why(model, result, work, cluster)
        if unbuilt is not None:
            doc["unbuilt"] = {**unbuilt[0].to_json(), "gain": round(unbuilt[1], 4)}
        print(json.dumps(doc, indent=1))
        return 0 if result.ranked else 1
    if not result.ranked:
        near = result.smallest_shortfall()
        msg = f"no layout of {args.model} fits on {cluster.world_size} x {cluster.gpu.name}"
        if near is not None:
            msg += f"; the closest ({near.layout.short()}) needs {near.shortfall_gib:.2f} GiB more per GPU"
        elif result.rejected_rules:
            msg += "; every factorisation breaks a rule: " + "; ".join(list(result.rejected_rules)[:3])
        if unbuilt is not None:
            msg += f"; {_unbuilt_line(*unbuilt)}"
        print(f"hybridpar: {msg}", file=sys.stderr)
        return 1
    print(f"{args.model} on {cluster.nodes} x {cluster.gpus_per_node} {cluster.gpu.name}, global batch "
          f"{work.global_batch} x {work.seq_len} tokens, {work.precision}")
    print(header(moe))
    for ev in result.ranked[:args.top]:
        print(_row(ev, moe))
    print(f"\n{result.fitting} layouts fit; {len(result.too_big)} do not fit; "
          f"{sum(map(len, result.rejected_rules.values()))} break a rule")
    print("\n".join(why(model, result, work, cluster)))
    if moe:
        print(explain_ep(model, result.ranked[0], work, cluster, imbalance, source))
    if unbuilt is not None:
        print(_unbuilt_line(*unbuilt))
    return 0


def _unbuilt_line(ev: Evaluation, gain: float) -> str:
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
