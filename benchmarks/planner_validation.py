"""The planner against the runtime on this machine: peak activation bytes (tiny model) and comm
payload bytes per axis (every layout of the invariance matrix), predicted vs measured.

Runs the measurement code of ``tests/test_planner_validation.py`` (which checks a subset of the
layouts on every test run) over all of them, with the tests' worker pool. Prints two tables and
one JSON line; exits 1 if any comm count differs or any activation peak is off by more than 10%.

``--from-run``: the held-out check of learning from runs (issue 34): two ``hybridpar train`` runs
of one model on this machine at micro-batch 2 and 8 (one process each, CPU), the efficiency
terms fitted on the first (``hybridpar.planner.front.fit``), the second's step time predicted from that
fit and compared with its measured median; and both runs' peak resident set against the
allocator model. Reported, not asserted (the machine's load moves step times by 10-20%).

    python benchmarks/planner_validation.py [--skip-activations] [--skip-comm] [--from-run]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


FIT_MODEL = ["--model.dim", "128", "--model.n_layers", "4", "--model.n_heads", "4", "--model.n_kv_heads", "2",
             "--model.ffn_hidden", "384", "--train.seq_len", "128", "--train.global_batch", "8",
             "--train.steps", "8", "--train.log_every", "1", "--train.eval_every", "0", "--train.sample_tokens", "4",
             "--train.device", "cpu"]


def held_out_fit(tmp: str) -> dict[str, object]:
    """Fit on a micro-batch-2 run, predict a micro-batch-8 run (see the module doc)."""
    import subprocess

    from hybridpar.planner.front.fit import base_gpu, fit_runs, predict, predicted_peak, read_run

    runs = []
    for mb in (2, 8):
        out = os.path.join(tmp, f"fit-mb{mb}")
        subprocess.run([sys.executable, "-m", "hybridpar.cli", "train", *FIT_MODEL, "--train.micro_batch", str(mb),
                        "--train.run_dir", out], check=True, capture_output=True)
        runs.append(read_run(out))
    base, _, _ = base_gpu(runs[0])
    fitted = fit_runs(runs[:1], base)
    doc: dict[str, object] = {}
    for name, run in zip(("fitted_on_mb2", "held_out_mb8"), runs, strict=True):
        p = predict(run, fitted)
        rss = predicted_peak(run)
        doc[name] = {"measured_s": run.step_time_s, "predicted_s": p, "error": p / run.step_time_s - 1,
                     "measured_rss": max(run.peak_memory), "predicted_rss": rss,
                     "rss_error": rss / max(run.peak_memory) - 1}
        print(f"{name:<14} step measured {run.step_time_s:.4f} s, predicted {p:.4f} s ({100 * (p / run.step_time_s - 1):+.1f}%); "
              f"peak RSS measured {max(run.peak_memory) / 2**20:.0f} MiB, predicted {rss / 2**20:.0f} MiB "
              f"({100 * (rss / max(run.peak_memory) - 1):+.1f}%)")
    return doc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-activations", action="store_true")
    parser.add_argument("--skip-comm", action="store_true")
    parser.add_argument("--from-run", action="store_true", help="the held-out fit check (module doc)")
    args = parser.parse_args()
    os.environ.setdefault("HYBRIDPAR_CACHE", tempfile.mkdtemp(prefix="hybridpar-cache-"))
    from harness import shutdown_pool
    from test_layouts import LAYOUTS
    from test_planner_validation import ACT_LAYOUTS, Runs

    doc: dict[str, object] = {"benchmark": "planner_validation"}
    ok = True
    tmp = tempfile.mkdtemp(prefix="planner-validation-")
    if args.from_run:
        doc["from_run"] = held_out_fit(tmp)
    runs = Runs(tmp, [] if args.skip_activations else list(ACT_LAYOUTS), [] if args.skip_comm else list(LAYOUTS))
    try:
        if not args.skip_activations:
            t0 = time.perf_counter()
            print(f"{'layout':<18} {'pp rank':>7} {'predicted B':>12} {'measured B':>12} {'error':>8}")
            worst = 0.0
            for name in ACT_LAYOUTS:
                for pp_rank, predicted, measured in sorted(set(runs.activations(name))):
                    err = (predicted - measured) / measured
                    worst = max(worst, abs(err))
                    print(f"{name:<18} {pp_rank:>7} {predicted:>12,.0f} {measured:>12,} {100 * err:>+7.3f}%")
            ok &= worst <= 0.10
            doc["activation_max_abs_error"] = worst
            doc["activation_layouts"] = len(ACT_LAYOUTS)
            print(f"activations: {len(ACT_LAYOUTS)} layouts, max |error| {100 * worst:.3f}% "
                  f"({time.perf_counter() - t0:.0f} s)\n")
        if not args.skip_comm:
            t0 = time.perf_counter()
            print(f"{'layout':<28} {'pp':>2} {'axis':<12} {'predicted B':>12} {'counted B':>12}")
            mismatches = 0
            for name in LAYOUTS:
                for pp_rank, counted, predicted in sorted(runs.comm(name), key=lambda r: r[0]):
                    for axis in sorted(set(counted) | set(predicted)):
                        p, c = predicted.get(axis, 0), counted.get(axis, 0)
                        mismatches += p != c
                        flag = "" if p == c else "  MISMATCH"
                        print(f"{name:<28} {pp_rank:>2} {axis:<12} {p:>12,} {c:>12,}{flag}")
            ok &= mismatches == 0
            doc["comm_layouts"] = len(LAYOUTS)
            doc["comm_mismatches"] = mismatches
            print(f"comm: {len(LAYOUTS)} layouts, {mismatches} mismatching (rank, axis) entries "
                  f"({time.perf_counter() - t0:.0f} s)")
    finally:
        shutdown_pool()
        shutil.rmtree(tmp, ignore_errors=True)
    doc["ok"] = ok
    print(json.dumps(doc))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
