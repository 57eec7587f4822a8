"""``hybridpar train --dry-run``: the command line and the report of :mod:`hybridpar.training.dryrun`.

``hybridpar train --dry-run [--world N] [--ranks R,...] [--steps K] [--json] [--hf-config PATH]
[--config FILE] [--section.key value ...]`` takes the config a real run takes (a preset, the
``--model.*`` keys, or a Hugging Face ``config.json`` with no weights beside it), refuses a layout
the rules refuse before anything is built, and prints per rank each measure beside the planner's
and their difference; ``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hybridpar.config import Config, ConfigError, load_config, validate
from hybridpar.training.dryrun import RankRun, default_ranks, dry_run, parse_ranks

GiB = 2**30


def dry_run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hybridpar train --dry-run",
        description="Build one rank's share of the model for a world of N processes and run real training "
        "steps on fake tensors and torch's fake process group; print memory, traffic and FLOPs per rank "
        "beside the planner's prediction. Any config key can be given as --section.key value.")
    p.add_argument("--dry-run", action="store_true", required=True)
    p.add_argument("--config", help="TOML file with [model], [parallel], [train] tables")
    p.add_argument("--world", type=int, default=None,
                   help="processes of the cluster (default: the layout's dp*tp*pp*cp; with --parallel.auto "
                   "the layout is planned for it)")
    p.add_argument("--ranks", default=None, help="comma-separated ranks to run (default: the ranks that differ: "
                   "first, middle and last pipeline stage, an expert-parallel rank, the uneven ZeRO remainder)")
    p.add_argument("--steps", type=int, default=2, help="training steps per rank; the last is measured (default 2)")
    p.add_argument("--hf-config", default=None, metavar="PATH",
                   help="a Hugging Face config.json (or its directory; no weights needed): the model to size")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return p


def dry_run_config(argv: list[str]) -> tuple[Config, argparse.Namespace]:
    """The run's config as a real run reads it, the layout planned for ``--world`` under
    ``parallel.auto``, and every rule checked (before any process group exists)."""
    args, overrides = dry_run_parser().parse_known_args(argv)
    if args.hf_config is None:
        cfg = load_config(args.config, overrides)
    else:  # read as train.init_from reads a model (explicit --model.* keys must agree), with no weights
        from hybridpar.models.hf import model_config_from_hf

        where = Path(args.hf_config)
        where = where.parent if where.name == "config.json" else where
        cfg = load_config(args.config, [*overrides, "--train.init_from", str(where)], init_model=model_config_from_hf)
        cfg.train.init_from = ""
    world = args.world if args.world is not None else cfg.parallel.world_size
    if cfg.parallel.auto:
        from hybridpar.planner.front.auto import auto_config

        cfg = auto_config(cfg, world)
    elif world != cfg.parallel.world_size:
        p = cfg.parallel
        raise ConfigError(f"--world {world} != dp * tp * pp * cp = {p.dp} * {p.tp} * {p.pp} * {p.cp} = "
                          f"{p.world_size}; set the layout's axes to multiply to {world}, or --parallel.auto true")
    validate(cfg, world_size=world)
    return cfg, args


def cmd_dry_run(argv: list[str]) -> int:
    """Entry point of ``hybridpar train --dry-run``."""
    cfg, args = dry_run_config(argv)
    ranks = default_ranks(cfg)
    if args.ranks is not None:
        why = dict(ranks)
        ranks = [(r, why.get(r, "named with --ranks")) for r in parse_ranks(args.ranks, cfg.parallel.world_size)]
    runs = dry_run(cfg, ranks, args.steps)
    print(json.dumps(report_json(cfg, runs)) if args.json else format_report(cfg, runs))
    return 0


def describe_layout(cfg: Config) -> str:
    p, t = cfg.parallel, cfg.train
    axes = " ".join(f"{k}{getattr(p, k)}" for k in ("dp", "tp", "pp", "cp", "ep") if getattr(p, k) > 1) or "1 rank"
    extra = [f"zero{p.zero_stage}"] if p.zero_stage else []
    extra += ["sp"] if p.sequence_parallel and p.tp > 1 else []
    extra += [f"recompute={p.recompute}"] if p.recompute != "none" else []
    return (f"{cfg.model.preset or cfg.model.family} on {p.world_size:,} ranks: {axes} {' '.join(extra)}; "
            f"global batch {t.global_batch} x {t.seq_len} tokens, micro-batch {t.micro_batch}, {t.precision}")


def report_json(cfg: Config, runs: list[RankRun]) -> dict[str, Any]:
    return {"layout": describe_layout(cfg), "world": cfg.parallel.world_size,
            "ranks": [r.as_dict() for r in runs], "peak_rank": peak_rank(runs).rank if runs else None}


def peak_rank(runs: list[RankRun]) -> RankRun:
    return max(runs, key=lambda r: r.memory.get("total", 0))


def _pct(measured: float, planned: float) -> str:
    return f"{100 * (measured - planned) / planned:+.2f}%" if planned else "n/a"


def format_rank(r: RankRun) -> list[str]:
    """The lines of one rank: traffic per axis, FLOPs and memory, each beside the planner's."""
    coords = " ".join(f"{k}={v}" for k, v in r.coords.items())
    lines = [f"rank {r.rank} ({coords}): {r.why}  [{r.seconds:.1f} s]"]
    for axis, diff in r.traffic_diff().items():
        lines.append(f"  traffic {axis:<12} {r.traffic.get(axis, 0):>18,} B   planner {r.traffic_planned.get(axis, 0):>18,} B"
                     f"   diff {diff:+,}")
    lines.append(f"  FLOPs                {r.flops:>18,}     planner {r.flops_planned:>18,}     diff "
                 f"{r.flops - r.flops_planned:+,}")
    m, p = r.memory, r.memory_planned
    split = ", ".join(f"{k} {m[k] / GiB:.3f}" for k in ("params", "grads", "optimizer", "buffers", "activations"))
    plan = ", ".join(f"{k} {p[k] / GiB:.3f}" for k in ("params", "grads", "optimizer", "activations", "logits",
                                                       "comm_buffers"))
    lines.append(f"  memory peak {m['total'] / GiB:.3f} GiB ({split})")
    lines.append(f"  planner tensors {p['tensors'] / GiB:.3f} GiB ({plan}); diff {_pct(m['total'], p['tensors'])}; "
                 f"+ allocator overhead {p['overhead'] / GiB:.3f} GiB (modelled separately)")
    return lines


def format_report(cfg: Config, runs: list[RankRun]) -> str:
    lines = [f"dry run: {describe_layout(cfg)}"]
    for r in runs:
        lines += format_rank(r)
    if runs:
        top = peak_rank(runs)
        kind = max(("params", "grads", "optimizer", "buffers", "activations"), key=lambda k: top.memory[k])
        lines.append(f"peak: rank {top.rank} ({top.why}), {top.memory['total'] / GiB:.3f} GiB, mostly {kind}")
    return "\n".join(lines)
