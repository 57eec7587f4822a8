"""Goodput under injected failures: disk checkpoints only against in-memory snapshots.

One job of 8 gloo processes as 2 nodes of 4 (two ``hybridpar train --elastic 8:8 --nproc 4
--rdzv-endpoint`` launchers on 127.0.0.1, c10d rendezvous), on the demo layout (dp2 x tp2 x pp2,
micro-batch 4, the tiny preset). Every ``--interval`` seconds after the job last made progress,
one failure from ``--failures``:

* ``worker``: ``kill -9`` of a random worker of the job (found by its ``RANK`` and the job's
  ``TORCHELASTIC_RUN_ID`` in ``/proc``); both launchers restart their workers;
* ``node``: ``kill -9`` of a whole node's launcher with its workers (their snapshot store goes with
  them), and a fresh launcher started in its place, which the survivors wait for. It is the node
  that does not host the c10d rendezvous store: losing that one ends the job under any torch
  elastic launcher.

Rows, each its own job with the same model, data and failures:

* ``free``: no failures, disk checkpoints every ``--disk-every`` steps, no snapshots (the goodput
  reference);
* ``disk``: the failures, disk checkpoints only (``train.snapshot_every = 0``);
* ``snapshot``: the failures, the defaults a user gets with ``--max-restarts``/``--elastic``
  (in-memory snapshots every step, replicated to the other node) beside the same disk checkpoints.

Per failure: the steps lost (completed steps the job trained again) and the recovery time (the
kill to the next completed step, seen in ``metrics.jsonl``), split by the lines the job prints,
time-stamped as they arrive: ``detect`` (the kill to the launcher's "lost a peer" line; for a
node, to the survivors' "restart" decision), ``restart`` (to rank 0's "restart N of the job" line:
the agents' rendezvous, new processes, imports, the process group, the agreement on where to
continue), ``build`` (to the Trainer's "resumed from" line, less the load), ``load`` (the
Trainer's own measurement), ``first step`` (to the first completed step). Goodput: the failure-free
run's span from its first to its last completed step over this row's. The output is a table and
one JSON line.

    nice python benchmarks/goodput.py [--steps 40] [--interval 40] [--failures worker,worker,node]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _spawn import free_port, listening

DEMO = ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2", "--train.micro_batch", "4"]
RUN = ["--train.log_every", "1", "--train.eval_every", "0", "--train.sample_tokens", "0"]
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1"


class Job:
    """One job of two launchers; their lines and the completed steps, time-stamped on arrival."""

    def __init__(self, run_dir: Path, steps: int, extra: list[str], restarts: int) -> None:
        self.run_dir, self.port, self.rdzv_id = run_dir, free_port(), f"goodput-{os.getpid()}-{time.time_ns()}"
        self.argv = ["train", *DEMO, *RUN, "--train.steps", str(steps), "--train.run_dir", str(run_dir), *extra,
                     "--elastic", "8:8", "--nproc", "4", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id",
                     self.rdzv_id, "--rdzv-conf", RDZV_CONF, "--max-restarts", str(restarts)]
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.lines: list[tuple[float, str]] = []
        self.stores: set[str] = set()  # the nodes' snapshot stores, as their workers name them
        self.steps: list[tuple[float, int]] = []  # (arrival, step) of every completed step, redone ones again
        self.nodes: list[subprocess.Popen] = [self._launch()]
        while not listening(self.port):  # node 0 hosts the rendezvous store: the one never lost
            if self.nodes[0].poll() is not None:
                raise RuntimeError("the first launcher exited before its rendezvous store listened")
            time.sleep(0.05)
        self.nodes.append(self._launch())
        self._watch = threading.Thread(target=self._poll_metrics, daemon=True)
        self._watch.start()

    def _launch(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "hybridpar.cli", *self.argv], env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()
        return proc

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            for part in line.rstrip("\n").split("\r"):  # progress bars share lines with messages
                self.lines.append((time.monotonic(), part))

    def _poll_metrics(self) -> None:
        seen: list[int] = []
        path = self.run_dir / "metrics.jsonl"
        while not getattr(self, "done", False):
            try:
                now = [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip().endswith("}")]
            except (OSError, json.JSONDecodeError):
                now = seen
            t = time.monotonic()
            if now[:len(seen)] != seen[:len(now)] or len(now) < len(seen):  # truncated by a resume
                seen = [s for s in seen if s in now]
            for s in now[len(seen):]:
                self.steps.append((t, s))
            seen = now
            time.sleep(0.05)

    def last_step(self) -> int:
        return self.steps[-1][1] if self.steps else 0

    def workers(self) -> list[int]:
        """The job's worker pids (their environment names this job and a rank)."""
        out = []
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                env = (p / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"TORCHELASTIC_RUN_ID={self.rdzv_id}".encode() in env and any(e.startswith(b"RANK=") for e in env):
                out.append(int(p.name))
                self.stores.update(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"HYBRIDPAR_SNAPSHOT_STORE="))
        return out

    def kill_worker(self, rng: random.Random) -> str:
        pid = rng.choice(self.workers())
        rank = next(e for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if e.startswith(b"RANK="))
        os.kill(pid, signal.SIGKILL)
        return f"worker {rank.decode().lower()}"

    def kill_node(self, rng: random.Random) -> str:  # noqa: ARG002 - the same signature as kill_worker
        """The second node: the first hosts the c10d rendezvous store, whose loss ends any torch
        elastic job (torchrun's too), so a lost node here is one that does not host it."""
        i = 1
        self.workers()  # learn the node's store, which its SIGKILLed launcher leaves behind
        os.killpg(self.nodes[i].pid, signal.SIGKILL)
        self.nodes[i].wait()
        self.nodes[i] = self._launch()  # a replacement node joins the job
        return f"node {i} (launcher and its 4 workers)"

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        try:
            codes = [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in self.nodes]
        except subprocess.TimeoutExpired:
            codes = [1]
        time.sleep(0.2)
        self.done = True
        return max(abs(c) for c in codes)

    def stop(self) -> None:
        self.done = True
        for p in self.nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)

    def first(self, pattern: str, after: float) -> tuple[float, str] | None:
        return next(((t, x) for t, x in self.lines if t >= after and re.search(pattern, x)), None)


def _breakdown(job: Job, killed: float, recovered: float) -> dict[str, float | None]:
    """The recovery split by the job's lines (module doc); None where a line was not seen."""
    lost = job.first(r"lost a peer|restarts the job|Worker group FAILED", killed)
    restart = job.first(r"restart \d+ of the job|elastic: 8 processes, layout", killed)
    resumed = job.first(r"resumed from .* \(loaded in", killed)
    load = float(re.search(r"loaded in ([0-9.]+) s", resumed[1]).group(1)) if resumed else None
    parts: dict[str, float | None] = {"detect_s": lost[0] - killed if lost else None,
                                      "restart_s": restart[0] - (lost[0] if lost else killed) if restart else None}
    parts["build_s"] = resumed[0] - restart[0] - (load or 0) if resumed and restart else None
    parts["load_s"] = load
    parts["first_step_s"] = recovered - resumed[0] if resumed else None
    return parts


def run_row(name: str, steps: int, extra: list[str], failures: list[str], interval: float, seed: int,
            root: Path) -> dict:
    """One job; returns its failures and span (module doc)."""
    rng = random.Random(seed)
    job = Job(root / name, steps, extra, restarts=len(failures) + 1)
    events = []
    try:
        start = time.monotonic()
        while not job.steps:
            if time.monotonic() - start > 600 or any(p.poll() not in (None, 0) for p in job.nodes):
                raise RuntimeError(f"{name}: no step within 600 s:\n" + "\n".join(x for _, x in job.lines[-40:]))
            time.sleep(0.1)
        for kind in failures:
            progress = job.steps[-1][0]
            while time.monotonic() < progress + interval and job.last_step() < steps - 2:
                time.sleep(0.05)
            if job.last_step() >= steps - 2:
                break
            done_before, killed = job.last_step(), time.monotonic()
            what = job.kill_worker(rng) if kind == "worker" else job.kill_node(rng)
            # the next step completed after the job saw the failure (a step in flight at the kill
            # may still be logged by rank 0 before the others notice)
            while (seen := job.first(r"lost a peer|restart \d+ of the job", killed)) is None or not [
                    s for t, s in job.steps if t > seen[0]]:
                if time.monotonic() - killed > 900:
                    raise RuntimeError(f"{name}: no recovery after {what}:\n" + "\n".join(x for _, x in job.lines[-60:]))
                time.sleep(0.05)
            recovered, next_step = next((t, s) for t, s in job.steps if t > seen[0])
            events.append({"failure": what, "steps_lost": done_before - (next_step - 1),
                           "recovery_s": recovered - killed, **_breakdown(job, killed, recovered)})
        code = job.wait(timeout=1800)
        if code != 0:
            raise RuntimeError(f"{name}: the job failed ({code}):\n" + "\n".join(x for _, x in job.lines[-60:]))
    finally:
        job.stop()
        for leaked in job.stores:  # a SIGKILLed launcher's store (the others removed theirs)
            subprocess.run(["rm", "-rf", leaked], check=False)
    times = [t for t, _ in job.steps]
    deltas = [b - a for a, b in zip(times, times[1:], strict=False) if b - a > 0]
    return {"row": name, "failures": events, "span_s": times[-1] - times[0], "steps": steps,
            "median_step_s": statistics.median(deltas) if deltas else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--interval", type=float, default=40.0, help="seconds of progress between failures")
    ap.add_argument("--failures", default="worker,worker,node", help="worker and node failures, in order")
    ap.add_argument("--disk-every", type=int, default=50, help="train.checkpoint_every of every row")
    ap.add_argument("--rows", default="free,disk,snapshot")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    failures = [f for f in args.failures.split(",") if f]
    disk = ["--train.checkpoint_every", str(args.disk_every)]
    flags = {"free": [*disk, "--train.snapshot_every", "0"], "disk": [*disk, "--train.snapshot_every", "0"],
             "snapshot": disk}
    rows = []
    with tempfile.TemporaryDirectory(prefix="hybridpar-goodput-") as tmp:
        for name in args.rows.split(","):
            rows.append(run_row(name, args.steps, flags[name], [] if name == "free" else failures, args.interval,
                                args.seed, Path(tmp)))
    free = next((r for r in rows if r["row"] == "free"), None)
    for r in rows:
        r["goodput_vs_free"] = free["span_s"] / r["span_s"] if free else None
    _print(rows, args)


def _print(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"goodput, 8 gloo processes as 2 nodes (dp2 x tp2 x pp2, tiny), {args.steps} steps, a failure after each "
          f"{args.interval:.0f} s of progress ({args.failures}), disk checkpoints every {args.disk_every} steps")
    print(f"{'row':<9} {'span s':>8} {'goodput':>8} {'failure':<34} {'lost':>5} {'recover s':>9} "
          f"{'detect':>7} {'restart':>7} {'build':>6} {'load':>6} {'1st step':>8}")
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else "-"  # noqa: E731
    for r in rows:
        good = f"{100 * r['goodput_vs_free']:.1f}%" if r["goodput_vs_free"] else "-"
        print(f"{r['row']:<9} {r['span_s']:>8.1f} {good:>8}")
        for e in r["failures"]:
            print(f"{'':<27}{e['failure']:<34} {e['steps_lost']:>5} {e['recovery_s']:>9.2f} {fmt(e['detect_s']):>7} "
                  f"{fmt(e['restart_s']):>7} {fmt(e['build_s']):>6} {fmt(e['load_s']):>6} {fmt(e['first_step_s']):>8}")
    print(json.dumps({"benchmark": "goodput", "steps": args.steps, "interval_s": args.interval,
                      "failures": args.failures, "disk_every": args.disk_every, "rows": rows}))


if __name__ == "__main__":
    main()
