"""``hybridpar plan``: rank layouts for a model on a cluster, or explain one layout.

Answers in seconds without a GPU (timings in :mod:`hybridpar.planner.search.search`): the memory model (:mod:`hybridpar.planner.memory.plan`),
the cost model (:mod:`hybridpar.planner.price.cost`) and the search
(:mod:`hybridpar.planner.search.search`) do the work, :mod:`hybridpar.planner.front.explain` says
why; this module parses and prints. ``--dry-run [K]`` builds the top layouts with the trainer's
dry run (:mod:`hybridpar.training.dryrun_plan`, handed in by :mod:`hybridpar.cli` as a
:data:`DryRun`, since the planner sits below the trainer) and drops those that cannot build.
``hybridpar calibrate`` is :mod:`hybridpar.planner.front.calibrate_cli` (it needs torch; ``plan``
imports none).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from hybridpar.config import MODEL_PRESETS, ModelConfig, model_preset
from hybridpar.planner.front.explain import (
    dp_shard_reason,
    explain,
    explain_ep,
    header,
    moe_imbalance,
    offload_reason,
    pipeline_reasons,
    table_row,
    unbuilt_gain,
    unbuilt_line,
    why,
)
from hybridpar.planner.front.fit import from_run, read_run, training_run
from hybridpar.planner.front.resilience import lines, parse_duration, resilience
from hybridpar.planner.machine.hardware import GPUS, Cluster, PlanError, gpu_spec
from hybridpar.planner.model.layout import Workload, parse_layout
from hybridpar.planner.model.moe import DEFAULT_IMBALANCE
from hybridpar.planner.search.search import (
    Evaluation,
    SearchResult,
    complete,
    evaluate,
    search,
    with_cost,
)


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
                   help="fp8.recipe: the blocks' linear GEMMs in FP8 (priced at the GPU's FP8 rate plus scaling)")
    p.add_argument("--fp8-all-gather", action="store_true",
                   help="fp8.all_gather: ZeRO-3 layouts gather the FP8 linears' weights in FP8 (with --fp8 tensorwise)")
    p.add_argument("--loss-chunk-tokens", type=int, default=Workload.loss_chunk_tokens,
                   help="train.loss_chunk_tokens: the head and loss in chunks of this many tokens (0: unchunked)")
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    p.add_argument("--layout", help='evaluate one layout, e.g. "dp=8,tp=8,pp=16,cp=1" (other fields chosen by the planner)')
    p.add_argument("--dry-run", type=int, nargs="?", const=2, default=0, metavar="K",
                   help="dry-run the ranked layouts in order until K (default 2) have built, on fake tensors in this "
                        "process (hybridpar train --dry-run): drop any the trainer refuses or cannot build, and show "
                        "their measured traffic and memory beside the planner's")
    p.add_argument("--mttf", help="mean time to failure, e.g. 3h, at --mttf-gpus GPUs: the snapshot and checkpoint "
                   "intervals that maximise goodput at --gpus and the goodput to expect (Young/Daly)")
    p.add_argument("--mttf-gpus", type=int, default=16384, help="the GPUs --mttf was measured at (default 16384)")
    p.add_argument("--restart-s", type=float, default=60.0, help="with --mttf: seconds a restart takes before loading")
    p.add_argument("--durable-every", default="1h", help="with --mttf: disk checkpoints beside the snapshots")
    moe = p.add_mutually_exclusive_group()
    moe.add_argument("--moe-imbalance", type=float, default=None,
                     help=f"mixture of experts: max/mean tokens per expert to plan for (default {DEFAULT_IMBALANCE})")
    moe.add_argument("--from-run", metavar="DIR", action="append",
                     help="a hybridpar train run directory (repeatable): fit the efficiency model to its measured "
                          "step time, re-plan and say how the prediction for its layout moved; for mixture of "
                          "experts also take the routing imbalance it measured")
    return p


def load_model(spec: str) -> ModelConfig:
    """A preset name, or a Hugging Face ``config.json`` (or the directory holding it)."""
    path = Path(spec)
    if path.exists():
        # imported here, not for a cycle: the HF reader pulls in the model families and parallel/
        # (and torch's compiler with them, ~3.5 s) that a plan of a preset never needs (issue 44, 18)
        from hybridpar.models.hf import model_config_from_hf

        return model_config_from_hf(path.parent if path.is_file() else path, any_rope=True)
    if spec in MODEL_PRESETS:
        return model_preset(spec)
    raise PlanError(f"--model {spec!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor an existing "
                    "Hugging Face config.json / directory")


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


@dataclass
class _Question:
    """What ``hybridpar plan`` was asked, resolved: the model, cluster and workload (from the flags,
    or the fitted run's), the routing imbalance and where it came from, and the answer's head."""

    model: ModelConfig
    cluster: Cluster
    work: Workload
    moe_source: tuple[float, str]
    head: dict[str, object]


def _question(args: argparse.Namespace) -> _Question:
    """The flags resolved; with ``--from-run`` of a training run, fitted to it (which fills
    ``--model``, ``--gpus``, ... from it; an MoE run's summary alone gives only its imbalance)."""
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
    return _Question(model, cluster, work, (imbalance, source), head)


@dataclass
class Checked:
    """A ranked layout ``plan --dry-run`` tried: why it cannot build (one line), or the measures
    of its dry-run ranks beside the planner's (``hybridpar.training.dryrun_plan.measures``)."""

    evaluation: Evaluation
    refused: str | None = None
    ranks: list[dict[str, object]] = field(default_factory=list)


# (model, workload, ranked layouts, K) -> the layouts tried: the trainer's dry run, handed in by
# the front door (hybridpar.cli), since the planner sits below the trainer
DryRun = Callable[[ModelConfig, Workload, list[Evaluation], int], list[Checked]]


def cmd_plan(argv: list[str], dry_run: DryRun | None = None) -> int:
    args = _parser().parse_args(argv)
    q = _question(args)
    if args.layout:
        return _plan_layout(args, q.model, q.work, q.cluster, q.head, q.moe_source)
    result = search(q.model, q.work, q.cluster, top=args.top, runnable_top=True)
    checked = _dry_run(args, q, result, dry_run) if args.dry_run else []
    if checked and not result.ranked:
        print(f"hybridpar: none of the {len(checked)} layouts tried builds in this trainer; the first: "
              f"{checked[0].evaluation.layout.short()}: {checked[0].refused}", file=sys.stderr)
        return 1
    return _print_json(args, q, result, checked) if args.json else _print_table(args, q, result, checked)


def _dry_run(args: argparse.Namespace, q: _Question, result: SearchResult, dry_run: DryRun | None) -> list[Checked]:
    """``--dry-run K``: the layouts tried, the dropped ones removed from ``result.ranked``."""
    if dry_run is None:
        raise PlanError("plan --dry-run builds layouts with the trainer: run it as `hybridpar plan` (hybridpar.cli)")
    checked = dry_run(q.model, q.work, result.ranked[:args.top], args.dry_run)
    dropped = [c.evaluation for c in checked if c.refused is not None]
    result.ranked = [e for e in result.ranked if not any(e is d for d in dropped)]
    return checked


def dry_run_lines(checked: list[Checked]) -> list[str]:
    """What ``plan --dry-run`` prints before the table: each dropped layout with why, and each
    built one's ranks (traffic equal to the planner's or not, peak live tensors beside it)."""
    out = [f"dry run (fake tensors, 2 steps, in this process) of the ranked layouts until "
           f"{sum(c.refused is None for c in checked)} built:"]
    for c in checked:
        name = c.evaluation.layout.short()
        if c.refused is not None:
            out.append(f"  dropped {name}: {c.refused}")
            continue
        for r in c.ranks:
            diff = {a: d for a, d in r["traffic_diff"].items() if d}  # type: ignore[attr-defined]
            traffic = "traffic = planner's" if not diff else f"traffic differs from the planner's: {diff}"
            flops = "FLOPs = planner's" if r["flops"] == r["flops_planned"] else "FLOPs differ from the planner's"
            err = r["peak_error"]
            out.append(f"  {name} rank {r['rank']} ({r['why']}): {traffic}, {flops}; peak live tensors "
                       f"{int(r['peak_bytes']) / 2**30:.3f} GiB, planner {float(r['peak_planned_bytes']) / 2**30:.3f} GiB"  # type: ignore[call-overload, arg-type]
                       + (f" ({100 * float(err):+.1f}%)" if err is not None else ""))  # type: ignore[arg-type]
    return out


def _layout_json(ev: Evaluation, checked: list[Checked]) -> dict[str, object]:
    """A ranked layout's ``plan --json`` entry, with ``dry_run`` (its ranks) where it was dry-run."""
    out = ev.to_json()
    for c in checked:
        if c.evaluation is ev:
            out["dry_run"] = {"ranks": c.ranks}
    return out


def _print_json(args: argparse.Namespace, q: _Question, result: SearchResult, checked: list[Checked]) -> int:
    """``plan --json``: the ranked layouts, the closest that do not fit, the rejected rules, why;
    with ``--dry-run``, ``dry_run.dropped`` (each with its ``reason``)."""
    unbuilt = unbuilt_gain(result)
    doc = {**q.head, "layouts": [_layout_json(e, checked) for e in result.ranked[:args.top]],
           "too_big": [with_cost(e, q.model, q.work, q.cluster).to_json()
                       for e in sorted(result.too_big, key=lambda e: e.shortfall_gib)[:args.top]],
           "rejected": {rule: len(ls) for rule, ls in result.rejected_rules.items()}}
    if result.ranked:
        doc["why"] = why(q.model, result, q.work, q.cluster)
    if unbuilt is not None:
        doc["unbuilt"] = {**unbuilt[0].to_json(), "gain": round(unbuilt[1], 4)}
    if args.dry_run:
        doc["dry_run"] = {"dropped": [{**c.evaluation.to_json(), "reason": c.refused} for c in checked
                                      if c.refused is not None]}
    if args.mttf and result.ranked:
        doc["resilience"] = _resilience(args, q, result)
    print(json.dumps(doc, indent=1))
    return 0 if result.ranked else 1


def _print_table(args: argparse.Namespace, q: _Question, result: SearchResult, checked: list[Checked]) -> int:
    """``plan``'s table: the ranked layouts and why the best won, or why none fits (after the
    dry run's lines, with ``--dry-run``)."""
    unbuilt, cluster, work, moe = unbuilt_gain(result), q.cluster, q.work, q.model.n_experts > 0
    if not result.ranked:
        near = result.smallest_shortfall()
        msg = f"no layout of {args.model} fits on {cluster.world_size} x {cluster.gpu.name}"
        if near is not None:
            msg += f"; the closest ({near.layout.short()}) needs {near.shortfall_gib:.2f} GiB more per GPU"
        elif result.rejected_rules:
            msg += "; every factorisation breaks a rule: " + "; ".join(list(result.rejected_rules)[:3])
        if unbuilt is not None:
            msg += f"; {unbuilt_line(*unbuilt)}"
        print(f"hybridpar: {msg}", file=sys.stderr)
        return 1
    if checked:
        print("\n".join(dry_run_lines(checked)) + "\n")
    print(f"{args.model} on {cluster.nodes} x {cluster.gpus_per_node} {cluster.gpu.name}, global batch "
          f"{work.global_batch} x {work.seq_len} tokens, {work.precision}")
    print(header(moe))
    for ev in result.ranked[:args.top]:
        print(table_row(ev, moe))
    print(f"\n{result.fitting} layouts fit; {len(result.too_big)} do not fit; "
          f"{sum(map(len, result.rejected_rules.values()))} break a rule")
    print("\n".join(why(q.model, result, work, cluster)))
    if moe:
        print(explain_ep(q.model, result.ranked[0], work, cluster, *q.moe_source))
    if unbuilt is not None:
        print(unbuilt_line(*unbuilt))
    if args.mttf:
        print("\n".join(lines(_resilience(args, q, result))))
    return 0


def _resilience(args: argparse.Namespace, q: _Question, result: SearchResult) -> dict[str, object]:
    """``--mttf``: the best layout's snapshot and checkpoint intervals and goodput."""
    return resilience(result.ranked[0], q.cluster, parse_duration(args.mttf, "--mttf"), args.mttf_gpus,
                      args.restart_s, parse_duration(args.durable_every, "--durable-every"))
