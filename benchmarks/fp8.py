"""FP8 training against bf16 on the demo: final loss and step time, side by side.

Runs ``hybridpar train`` twice with the built-in demo's layout (``dp2 x tp2 x pp2``, 8
processes, the ``tiny`` model, 300 steps), once with ``train.precision = bf16`` and once with
``fp8.recipe = rowwise`` as well (``--recipe`` for another), and compares the loss at the last
step (issue 33's target: FP8 within 2% of bf16) and the median step time (on CPUs
``torch._scaled_mm`` is a reference kernel, slower than the bf16 GEMM: the speed claim is the GPU's,
``benchmarks/gpu.py --fp8``). Prints a table and one JSON line.

    python benchmarks/fp8.py [--steps 300] [--recipe rowwise] [--nproc 8] [--section.key value ...]

``--nproc 1`` drops the demo layout (one process, same model and data).

Measured on this 2-core machine (shared, load ~20-30), torch 2.13, 2026-11-27: bf16 final loss
1.8497 (val 1.6734), FP8 rowwise 1.8048 (val 1.6178): FP8 2.4% *lower*, outside the 2% band on
the favourable side; median step 0.96 s vs 2.21 s (CPU GEMM emulation, see compat.scaled_mm);
wall 346 s + 802 s, hence this benchmark and the short ``tests/test_fp8_training.py``. For scale,
the same demo in fp32 (one more CLI run, by hand): 1.7946 (val 1.6247).

Why that bf16 run sits 3% above fp32 (investigated 2026-11-27, same machine): not a defect of the
bf16 path, the spread of bf16 trajectories at one step. bf16 here is plain autocast (fp32 master
weights and gradient accumulation, fp32 residual stream: the embedding output is fp32 and each
block adds its bf16 branch into it; RMSNorm, RoPE and the loss in fp32; pipeline activations sent
in fp32), and the demo reruns bit for bit (1.8497 again). Step-300 loss (val) with seed 1234, by
``hybridpar train --train.steps 300 --train.eval_every 300 --train.precision P [layout]``:
one process (micro-batch 8) fp32 1.8024 (1.6225), bf16 1.8076 (1.6145); bf16 at micro-batch 4
over tp2 1.8047 (1.5985), pp2 1.7930 (1.6089), dp2 1.8085 (1.6050), tp2 x pp2 1.8167 (1.6283),
dp2 x tp2 1.8123 (1.6261), dp2 x pp2 1.8409 (1.6311), the demo 1.8497 (1.6734). After 4 steps the
demo's bf16 weights differ from one process's bf16 weights by no more than bf16's differ from
fp32's (max |diff| per tensor: ratio 0.05-1.45, fp32 layout vs one process 1e-7), so the layout
computes bf16 as one process does; the trajectories then part like any two bf16 runs. Other seeds
(``--train.seed``): seed 1, demo bf16 1.9278 (val 1.6930) vs one-process fp32 1.9019 (1.7001),
+1.4%; seed 2 (``python benchmarks/fp8.py --train.seed 2``), demo bf16 1.8048 (1.7133), demo fp32
1.7976 (1.7001), demo FP8 rowwise 1.8074 (1.7119): FP8 +0.15% of bf16. One logged step's loss
moves by 2-3% between equivalent runs of one seed, as much as the 2% band.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEMO = ("--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2", "--train.micro_batch", "4")


def run(name: str, steps: int, nproc: int, extra: list[str], root: Path) -> dict[str, Any]:
    """One CLI training run; its final loss (from summary.json) and median logged step time."""
    run_dir = root / name
    layout = list(DEMO) if nproc == 8 else []
    cmd = [sys.executable, "-m", "hybridpar.cli", "train", "--nproc", str(nproc), *layout,
           "--train.steps", str(steps), "--train.precision", "bf16", "--train.eval_every", str(steps),
           "--train.log_every", "10", "--train.run_dir", str(run_dir), *extra]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records if "step_time_s" in r and "loss" in r]
    return {"final_loss": summary["final_loss"], "val_loss": summary.get("val_loss"), "wall_s": wall,
            "median_step_s": statistics.median(times) if times else None, "fp8": summary.get("fp8")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--recipe", default="rowwise", choices=["tensorwise", "rowwise"])
    p.add_argument("--nproc", type=int, default=8, choices=[1, 8])
    args, extra = p.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        bf16 = run("bf16", args.steps, args.nproc, extra, root)
        fp8 = run("fp8", args.steps, args.nproc, [*extra, "--fp8.recipe", args.recipe], root)
    rel = fp8["final_loss"] / bf16["final_loss"] - 1
    print(f"{'run':<16}{'final loss':>12}{'val loss':>10}{'median step s':>16}{'wall s':>10}")
    for name, r in (("bf16", bf16), (f"fp8 {args.recipe}", fp8)):
        step = "n/a" if r["median_step_s"] is None else f"{r['median_step_s']:.4f}"
        val = "n/a" if r["val_loss"] is None else f"{r['val_loss']:.4f}"
        print(f"{name:<16}{r['final_loss']:>12.4f}{val:>10}{step:>16}{r['wall_s']:>10.1f}")
    print(f"fp8 / bf16 final loss - 1 = {rel:+.4f} (target |.| <= 0.02); steps {args.steps}, nproc {args.nproc}")
    print(json.dumps({"benchmark": "fp8", "steps": args.steps, "nproc": args.nproc, "recipe": args.recipe,
                      "bf16": bf16, "fp8": fp8, "final_loss_rel": rel, "within_2pct": abs(rel) <= 0.02}))


if __name__ == "__main__":
    main()
