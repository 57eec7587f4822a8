"""The dry run at the scale users train (``hybridpar train --dry-run``), row by row: real configs
from 8 to 16,384 GPUs, each rank's real training step on fake tensors and torch's fake process
group, beside the planner. Prints a human table and one JSON line (``--json-only``: the line).

    PYTHONPATH=src python benchmarks/dryrun.py [--rows ID,...] [--all-ranks]

By default each row runs its first and last pipeline stage (the ranks with the embedding and the
head); ``--all-ranks`` runs every rank :func:`hybridpar.training.dryrun.default_ranks` picks.
What agrees (traffic per axis to the byte, FLOPs exactly, peak live tensor bytes within 2%) is
in docs/explanation/planner-validation.md, section "The dry run at scale", with each row's time.
"""

from __future__ import annotations

import argparse
import json
import time

from hybridpar.training.dryrun import RankRun, default_ranks, dry_run
from hybridpar.training.dryrun_cli import dry_run_config

GiB = 2**30
BF16 = ["--train.precision", "bf16", "--train.micro_batch", "1"]
FP8 = [*BF16, "--train.fp8", "tensorwise", "--parallel.sequence_parallel", "true"]

# id -> (what, flags): the layouts of the issue's table (Llama 3's own long-context layout; the
# Megatron-Bridge FP8 rows of the planner's validation, benchmarks/planner_rows.json)
ROWS: dict[str, tuple[str, list[str]]] = {
    "llama3.1-8b-8gpu-zero3": ("Llama-3.1-8B on 8 GPUs, ZeRO-3", [
        "--model.preset", "llama3-8b", "--parallel.dp", "8", "--parallel.zero_stage", "3",
        "--train.seq_len", "8192", "--train.global_batch", "8", *BF16]),
    "llama3.1-70b-64gpu-tp8-pp8": ("Llama-3.1-70B on 64 GPUs, tp8 pp8", [
        "--model.preset", "llama3-70b", "--parallel.tp", "8", "--parallel.pp", "8", "--parallel.sequence_parallel",
        "true", "--train.seq_len", "8192", "--train.global_batch", "16", *BF16]),
    "llama3.1-405b-1024gpu-8k": ("Llama-3.1-405B on 1,024 GPUs at 8k, tp8 pp16 dp8", [
        "--model.preset", "llama3.1-405b", "--parallel.tp", "8", "--parallel.pp", "16", "--parallel.dp", "8",
        "--parallel.sequence_parallel", "true", "--train.seq_len", "8192", "--train.global_batch", "128", *BF16]),
    "llama3.1-405b-16384gpu-128k": ("Llama-3.1-405B on 16,384 GPUs at 128k, tp8 pp16 cp16 dp8", [
        "--model.preset", "llama3.1-405b", "--parallel.tp", "8", "--parallel.pp", "16", "--parallel.cp", "16",
        "--parallel.dp", "8", "--parallel.sequence_parallel", "true", "--parallel.recompute", "full",
        "--train.seq_len", "131072", "--train.global_batch", "128", *BF16]),
    "mixtral-8x22b-64gpu-ep8": ("Mixtral-8x22B on 64 GPUs, tp8 dp8 ep8 (HF config.json, no weights)", [
        "--hf-config", "benchmarks/models/mixtral-8x22b", "--parallel.tp", "8", "--parallel.dp", "8", "--parallel.ep",
        "8", "--parallel.sequence_parallel", "true", "--parallel.zero_stage", "1", "--train.seq_len", "8192",
        "--train.global_batch", "8", *BF16]),
    "qwen3-235b-a22b-256gpu-ep8": ("Qwen3-235B-A22B on 256 GPUs, tp4 pp8 dp8 ep8 (HF config.json)", [
        "--hf-config", "benchmarks/models/qwen3-235b-a22b", "--parallel.tp", "4", "--parallel.pp", "8",
        "--parallel.dp", "8", "--parallel.ep", "8", "--parallel.sequence_parallel", "true", "--parallel.zero_stage",
        "1", "--train.seq_len", "4096", "--train.global_batch", "64", *BF16]),
    "megatron-bridge-8b-fp8": ("Megatron-Bridge Llama3 8B FP8-CS, 8 GPUs, FSDP", [
        "--model.preset", "llama3-8b", "--parallel.dp", "8", "--parallel.zero_stage", "3",
        "--train.seq_len", "8192", "--train.global_batch", "8", *BF16, "--train.fp8", "tensorwise"]),
    "megatron-bridge-70b-fp8": ("Megatron-Bridge Llama3 70B FP8-CS, 64 GPUs, tp4 pp8 dp2", [
        "--model.preset", "llama3-70b", "--parallel.tp", "4", "--parallel.pp", "8", "--parallel.dp", "2",
        "--train.seq_len", "8192", "--train.global_batch", "16", *FP8]),
    "megatron-bridge-405b-fp8": ("Megatron-Bridge Llama3.1 405B FP8-CS, 1,024 GPUs, tp8 pp8 cp2 dp8", [
        "--model.preset", "llama3-405b", "--parallel.tp", "8", "--parallel.pp", "8", "--parallel.cp", "2",
        "--parallel.dp", "8", "--train.seq_len", "8192", "--train.global_batch", "64", *FP8]),
}


def run_row(row: str, all_ranks: bool) -> dict:
    what, flags = ROWS[row]
    cfg, _ = dry_run_config(["--dry-run", *flags, "--train.run_dir", f"/tmp/hybridpar-dryrun-{row}"])
    ranks = default_ranks(cfg)
    if not all_ranks:
        ranks = [(r, why) for r, why in ranks if "pipeline stage" in why or "expert" in why or r == 0][:3]
    start = time.perf_counter()
    runs = dry_run(cfg, ranks, steps=2)
    return {"row": row, "what": what, "world": cfg.parallel.world_size, "seconds": round(time.perf_counter() - start, 1),
            "ranks": [_summary(r) for r in runs]}


def _summary(r: RankRun) -> dict:
    diff = (r.memory["total"] - r.memory_planned["tensors"]) / r.memory_planned["tensors"]
    return {"rank": r.rank, "why": r.why, "seconds": round(r.seconds, 1), "traffic": r.traffic,
            "traffic_equal": r.traffic == r.traffic_planned, "flops": r.flops, "flops_equal": r.flops == r.flops_planned,
            "peak_bytes": r.memory["total"], "planned_tensor_bytes": round(r.memory_planned["tensors"]),
            "memory_diff": round(diff, 4)}


def table(rows: list[dict]) -> str:
    lines = [f"{'row':<30} {'rank':>5} {'peak GiB':>9} {'plan GiB':>9} {'diff':>7} {'traffic = plan':>15} "
             f"{'FLOPs = plan':>13} {'s':>6}  traffic per axis (GB)"]
    for row in rows:
        for r in row["ranks"]:
            axes = " ".join(f"{a}={b / 1e9:.2f}" for a, b in sorted(r["traffic"].items()))
            lines.append(f"{row['row']:<30} {r['rank']:>5} {r['peak_bytes'] / GiB:>9.2f} "
                         f"{r['planned_tensor_bytes'] / GiB:>9.2f} {100 * r['memory_diff']:>+6.2f}% "
                         f"{'yes' if r['traffic_equal'] else 'NO':>15} {'yes' if r['flops_equal'] else 'NO':>13} "
                         f"{r['seconds']:>6.0f}  {axes}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated row ids (default all: {', '.join(ROWS)})")
    p.add_argument("--all-ranks", action="store_true", help="every rank default_ranks picks, not just first/last stage")
    p.add_argument("--json-only", action="store_true")
    args = p.parse_args()
    rows = []
    for row in args.rows.split(","):
        rows.append(run_row(row, args.all_ranks))
        if not args.json_only:
            print(table(rows[-1:]), flush=True)
    print(json.dumps({"benchmark": "dryrun", "rows": rows}))


if __name__ == "__main__":
    main()
