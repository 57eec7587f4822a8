"""Multi-rank layouts with CUDA tensors on one GPU, each against one CUDA process.

NCCL refuses two ranks on one device, so each layout runs under the one-GPU test mode
(``HYBRIDPAR_SHARED_GPU=1``: every rank on ``cuda:0``, process groups on gloo, collectives staged
through host memory; :mod:`hybridpar.distributed.staging`). Its speed means nothing; what it
checks is that every rank's tensors, buffers and streams stay on the GPU through a real layout
(a CPU tensor in a CUDA path, pinned memory or stream misuse fail here and nowhere on CPU).

Each layout trains the demo model in fp32 for a few steps and is compared with the single CUDA
process by ``hybridpar compare`` (the invariance matrix's tolerances: losses to 1e-5 relative,
weights to 1% of lr per step). Layouts run side by side (``--jobs``).

    python benchmarks/gpu_multirank.py [--steps 6] [--jobs 5] [--only demo,zero3]

Without a GPU it says so and exits 2; ``--device cpu`` runs the same layouts on CPU (gloo), which
checks the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MOE = ["--model.family", "mixtral", "--model.n_experts", "4", "--model.moe_ffn_hidden", "64"]
#: name -> (processes, the flags of the layout, the flags of the model it trains)
LAYOUTS: dict[str, tuple[int, list[str], list[str]]] = {
    "demo dp2 tp2 pp2": (8, ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2"], []),
    "zero3 dp4": (4, ["--parallel.dp", "4", "--parallel.zero_stage", "3"], []),
    "cp2 ring x dp2": (4, ["--parallel.dp", "2", "--parallel.cp", "2"], []),
    "ep2 in dp4 (moe)": (4, ["--parallel.dp", "4", "--parallel.ep", "2"], MOE),
}
BASE = ["--train.precision", "fp32", "--train.global_batch", "8", "--train.micro_batch", "2",
        "--train.log_every", "1", "--train.eval_every", "0", "--train.sample_tokens", "0"]


def train(run: Path, nproc: int, flags: list[str], device: str, steps: int, timeout_s: float) -> tuple[int, str]:
    """``hybridpar train --nproc N`` under the one-GPU test mode: (exit status, output tail)."""
    src = str(Path(__file__).parents[1] / "src")
    env = {**os.environ, "HYBRIDPAR_SHARED_GPU": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "hybridpar", "train", "--nproc", str(nproc), *BASE, *flags,
            "--train.device", device, "--train.steps", str(steps), "--train.checkpoint_every", str(steps),
            "--train.run_dir", str(run)]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout_s:.0f} s"
    return done.returncode, (done.stdout + done.stderr)[-800:]


def compare(a: Path, b: Path) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "hybridpar", "compare", str(a), str(b)], capture_output=True,
                          text=True)
    return done.returncode, (done.stdout + done.stderr).strip()


def check(name: str, root: Path, device: str, steps: int, timeout_s: float,
          reference: dict[str, Path]) -> dict[str, Any]:
    """One layout's run and its comparison with the single process of the same model."""
    nproc, flags, model = LAYOUTS[name]
    start = time.perf_counter()
    run = root / name.split()[0]
    rc, tail = train(run, nproc, [*model, *flags], device, steps, timeout_s)
    out: dict[str, Any] = {"nproc": nproc, "seconds": round(time.perf_counter() - start, 1)}
    if rc != 0:
        return {**out, "status": f"train exit {rc}: {tail}"}
    rc, text = compare(run, reference["moe" if model else "dense"])
    return {**out, "status": "equal" if rc == 0 else "DIFFERS", "compare": text}


def run_all(device: str, steps: int, jobs: int, only: list[str], timeout_s: float) -> dict[str, Any]:
    names = [n for n in LAYOUTS if not only or n.split()[0] in only]
    with tempfile.TemporaryDirectory(prefix="hybridpar-multirank-") as tmp, ThreadPoolExecutor(jobs) as pool:
        root = Path(tmp)
        refs = {"dense": root / "ref_dense", "moe": root / "ref_moe"}
        futures = {k: pool.submit(train, p, 1, MOE if k == "moe" else [], device, steps, timeout_s)
                   for k, p in refs.items()}
        failed = {k: f"reference exit {rc}: {tail}" for k, f in futures.items() for rc, tail in [f.result()] if rc}
        if failed:
            return {"references": failed}
        runs = {n: pool.submit(check, n, root, device, steps, timeout_s, refs) for n in names}
        return {n: f.result() for n, f in runs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--jobs", type=int, default=5, help="runs side by side")
    ap.add_argument("--only", default="", help="comma-separated layout names (demo, zero3, cp2, ep2)")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("benchmarks/gpu_multirank.py: no GPU is visible; pass --device cpu to check the script",
                  file=sys.stderr)
            return 2
    result = run_all(args.device, args.steps, args.jobs, [s for s in args.only.split(",") if s], args.timeout)
    for name, r in result.items():
        status = r if isinstance(r, str) else r["status"]
        print(f"  multirank {name:<20} {status[:300]}" + (f"  ({r['nproc']} ranks, {r['seconds']} s)"
                                                         if isinstance(r, dict) else ""))
        if isinstance(r, dict) and r.get("compare"):
            print("    " + r["compare"].replace("\n", "\n    "))
    print(json.dumps({"benchmark": "gpu_multirank", "device": args.device, "results": result}))
    ok = all(isinstance(r, dict) and r["status"] == "equal" for r in result.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
