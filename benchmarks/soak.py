"""Soak: does a layout run to the end every time, and does a long run survive lost ranks?

Two modes, each printing a table and one JSON line:

* ``repeat`` (default): run ``hybridpar train --nproc 8`` on the demo's 3D layout (dp2 x tp2 x pp2)
  ``--runs`` times, optionally beside a CPU hog (``--hog N`` busy processes), and count the runs
  that did not exit 0 with ``summary.json`` and ``sample.txt`` written, and the aborts among them
  (``terminate called``/SIGABRT, the teardown race this project once had: target 0 in 50).

      python benchmarks/soak.py --runs 50 [--hog 2]

* ``long``: one run of ``--steps`` (default 2000) steps with a checkpoint every 50 under
  ``--max-restarts 3``, where a rank is SIGKILLed at three random steps; then the same run
  uninterrupted. Reports whether the final weights are bit for bit equal, and the per-rank host
  RSS slope after warm-up in MiB per 1,000 steps (target below 1).

      python benchmarks/soak.py --mode long [--steps 2000] [--layout "--parallel.dp 2"]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEMO = ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2", "--train.global_batch", "32",
        "--train.micro_batch", "4"]


SMALL = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
         "--model.ffn_hidden", "64", "--model.max_seq_len", "64", "--train.seq_len", "32",
         "--train.global_batch", "4", "--train.micro_batch", "2"]


def _hog(stop: float) -> None:
    x = 0
    while time.time() < stop:
        x += 1


def _train(args: list[str], log: Path, timeout: float) -> tuple[int, float]:
    cmd = [sys.executable, "-m", "hybridpar.cli", "train", *args]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            code = p.wait()
    return code, time.perf_counter() - t0


def repeat(a: argparse.Namespace) -> dict:
    layout = shlex.split(a.layout) if a.layout else DEMO
    hogs = [mp.Process(target=_hog, args=(time.time() + 24 * 3600,), daemon=True) for _ in range(a.hog)]
    for h in hogs:
        h.start()
    rows, failures, aborts = [], 0, 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(a.runs):
                run_dir = Path(tmp) / f"run-{i}"
                log = Path(tmp) / f"run-{i}.log"
                code, secs = _train(["--nproc", str(a.nproc), *layout, "--train.steps", str(a.steps),
                                     "--train.run_dir", str(run_dir)], log, a.timeout)
                text = log.read_text(errors="replace")
                whole = (run_dir / "summary.json").is_file() and (run_dir / "sample.txt").is_file()
                aborted = "terminate called" in text or "SIGABRT" in text or "Signals.SIGABRT" in text
                ok = code == 0 and whole and not aborted
                failures += not ok
                aborts += aborted
                rows.append((i, code, whole, aborted, secs))
                print(f"run {i:3d}: exit {code:4d}  summary {'yes' if whole else 'NO '}  "
                      f"abort {'YES' if aborted else 'no '}  {secs:6.1f} s", flush=True)
                if not ok:
                    keep = Path(a.keep_logs) / f"soak-failure-{i}.log"
                    keep.parent.mkdir(parents=True, exist_ok=True)
                    keep.write_text(text)
                    print(f"         log kept in {keep}", flush=True)
    finally:
        for h in hogs:
            h.terminate()
    print(f"\n{a.runs} runs of {' '.join(layout)} ({a.steps} steps, {a.nproc} processes, {a.hog} hog(s)): "
          f"{failures} failed, {aborts} aborted")
    return {"bench": "soak", "mode": "repeat", "runs": a.runs, "failed": failures, "aborted": aborts,
            "hog": a.hog, "layout": " ".join(layout), "median_s": sorted(r[4] for r in rows)[len(rows) // 2]}


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _workers(run_dir: Path) -> list[int]:
    """Worker processes of the run in ``run_dir`` (their command line names it)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hybridpar.cli" in cmd and str(run_dir).encode() in cmd and b"--nproc" not in cmd:
            out.append(int(proc.name))
    return out


def _last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, json.JSONDecodeError, KeyError, IndexError):
        return 0


def _slope(samples: list[tuple[int, float]]) -> float:
    """Least-squares MiB per 1,000 steps."""
    if len(samples) < 3:
        return float("nan")
    n = len(samples)
    mx = sum(s for s, _ in samples) / n
    my = sum(v for _, v in samples) / n
    sxx = sum((s - mx) ** 2 for s, _ in samples)
    return 1000 * sum((s - mx) * (v - my) for s, v in samples) / sxx if sxx else float("nan")


def long(a: argparse.Namespace) -> dict:
    import torch

    from hybridpar.training.checkpoint import load_model_state, step_dir

    # a small model by default: the soak is about restarts and memory growth, not compute
    layout = shlex.split(a.layout) if a.layout else [*SMALL, "--parallel.dp", "2"]
    common = [*layout, "--train.steps", str(a.steps), "--train.checkpoint_every", "50", "--train.log_every", "10",
              "--train.eval_every", "0"]
    nproc = a.nproc if a.layout else 2
    rng = random.Random(a.seed)
    kills = sorted(rng.sample(range(60, a.steps - 10), 3))
    with tempfile.TemporaryDirectory() as tmp:
        ref, run = Path(tmp) / "uninterrupted", Path(tmp) / "killed"
        launch = [sys.executable, "-m", "hybridpar.cli", "train", "--nproc", str(nproc), *common]
        code, killed_s, text, _ = _watch([*launch, "--max-restarts", "3", "--train.run_dir", str(run)], run,
                                         Path(tmp) / "killed.log", kills, rng, a.warmup)
        code_ref, ref_s, _, rss = _watch([*launch, "--train.run_dir", str(ref)], ref, Path(tmp) / "ref.log",
                                         [], rng, a.warmup)
        equal = False
        if code == 0 and code_ref == 0:
            _, want = load_model_state(step_dir(ref, a.steps))
            _, got = load_model_state(step_dir(run, a.steps))
            equal = want.keys() == got.keys() and all(torch.equal(got[k], v) for k, v in want.items())
        slopes = {slot: _slope(s) for slot, s in rss.items()}
        print(f"\n{a.steps} steps, {' '.join(layout)}, SIGKILL at steps {kills}: exit {code} "
              f"({text.count('restart ')} restart lines), reference exit {code_ref}")
        print(f"final weights bit for bit equal to the uninterrupted run: {equal}")
        print(f"host RSS slope of the uninterrupted run from step {a.warmup} on, MiB per 1,000 steps: "
              + ", ".join(f"rank {s}: {v:+.2f}" for s, v in slopes.items()))
        print(f"wall: killed run {killed_s:.0f} s, uninterrupted {ref_s:.0f} s")
        if code != 0:
            print(text[-3000:])
    return {"bench": "soak", "mode": "long", "steps": a.steps, "kills": kills, "exit": code, "equal": equal,
            "rss_slope_mib_per_1k_steps": slopes}


def _watch(cmd: list[str], run: Path, log_path: Path, kills: list[int], rng: random.Random,
           warmup: int) -> tuple[int, float, str, dict[int, list[tuple[int, float]]]]:
    """Run ``cmd`` to its end, SIGKILLing a random worker once the run passes each step in
    ``kills``; returns exit status, seconds, output and each rank's (step, RSS MiB) samples after
    ``warmup`` (until the first kill)."""
    t0 = time.perf_counter()
    rss: dict[int, list[tuple[int, float]]] = {}
    pending = list(kills)
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while p.poll() is None:
            time.sleep(0.5)
            step = _last_step(run)
            pids = sorted(_workers(run))
            if len(pending) == len(kills) and step > warmup:
                for slot, pid in enumerate(pids):
                    if (v := _rss_mib(pid)) is not None:
                        rss.setdefault(slot, []).append((step, v))
            if pending and step >= pending[0] and pids:
                victim = rng.choice(pids)
                print(f"step {step}: SIGKILL worker pid {victim}", flush=True)
                os.kill(victim, signal.SIGKILL)
                pending.pop(0)
                time.sleep(3)
    return p.returncode, time.perf_counter() - t0, log_path.read_text(errors="replace"), rss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("repeat", "long"), default="repeat")
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--steps", type=int, default=None, help="steps per run (repeat: 6, long: 2000)")
    p.add_argument("--nproc", type=int, default=8)
    p.add_argument("--layout", default="", help="layout options (default: the demo's dp2 tp2 pp2)")
    p.add_argument("--hog", type=int, default=0, help="busy processes beside the runs")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run before it counts as hung")
    p.add_argument("--warmup", type=int, default=200, help="steps before RSS samples count (long)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-logs", default="soak-logs")
    a = p.parse_args()
    if a.steps is None:
        a.steps = 6 if a.mode == "repeat" else 2000
    print(json.dumps(repeat(a) if a.mode == "repeat" else long(a)))


if __name__ == "__main__":
    main()
