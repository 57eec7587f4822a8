"""Elastic restart time: how long a job that loses a node takes to continue on the node left.

Two local launchers form one elastic job of 2 processes (1 per "node", c10d rendezvous on
127.0.0.1, ``--nnodes 1:2``): the survivor is ``torchrun``, the other ``hybridpar train
--elastic 1:2 --nproc 1 --rdzv-endpoint``. The second node is lost (its agent and worker
SIGKILLed, by ``tests/faults/sitecustomize.py``) right after step 3, one step past the step-2
checkpoint. The survivor's lines are time-stamped as they arrive, which splits its restart into:

* ``detect``: the node's death to the survivor's agent seeing its worker fail (the worker's
  collective errors when the peer's connection closes);
* ``rendezvous``: the agent's new c10d round with the one node left (its ``last_call_timeout``,
  ``--last-call`` here, is the wait for more nodes and part of it);
  and c10d's keep-alive expiry of the dead node (``keep_alive_interval`` x ``keep_alive_max_attempt``,
  torch's default 5 s x 3; ``--keep-alive`` sets the interval) are most of it;
* ``start``: from the completed rendezvous to the restarted worker's re-plan (interpreter, imports,
  the planner);
* ``setup``: the re-plan to the Trainer's first line, less the load: process group, agreeing on
  the checkpoint, building the model under the new layout;
* ``load``: the resharded checkpoint load (the Trainer's own measurement, in its log line);
* ``total``: the node's death to the survivor's first line after the load (the sum of the above).

For the tiny preset and a ~100M-parameter model (dim 768, 13 layers, 12 heads):

    python benchmarks/elastic.py [--models tiny,100m] [--last-call 1] [--keep-alive 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _spawn import free_port, listening

from hybridpar.distributed.launch import SHARED_STORE_ENV

FAULTS = Path(__file__).resolve().parent.parent / "tests" / "faults"
MODELS = {
    "tiny": ["--model.preset", "tiny"],
    "100m": ["--model.dim", "768", "--model.n_layers", "13", "--model.n_heads", "12", "--model.n_kv_heads", "12",
             "--model.ffn_hidden", "2304", "--model.vocab_size", "256", "--model.max_seq_len", "128"],
}
TRAIN = ["--train.steps", "4", "--train.checkpoint_every", "2", "--train.seq_len", "64", "--train.global_batch", "2",
         "--train.micro_batch", "1", "--train.log_every", "1", "--train.eval_every", "0", "--train.sample_tokens", "4",
         "--parallel.dp", "2"]


class Stamped:
    """Reads a process's output in a thread and keeps (arrival time, line)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, pattern: str, after: float = 0.0) -> tuple[float, str]:
        for t, line in self.lines:
            if t >= after and re.search(pattern, line):
                return t, line
        raise RuntimeError(f"no line matching {pattern!r}; last lines:\n" + "\n".join(x for _, x in self.lines[-30:]))

    def join(self) -> None:
        self._thread.join(timeout=10)


def restart_time(model: str, last_call: int, keep_alive: int, run_dir: Path, log: Path | None = None) -> dict[str, float]:
    """One job with a lost node; the survivor's restart split into its parts (seconds)."""
    port = free_port()
    job = ["train", *MODELS[model], *TRAIN, "--train.run_dir", str(run_dir), "--elastic", "1:2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO", SHARED_STORE_ENV: "1"}
    survivor = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "bench",
         "--max-restarts", "1", "--rdzv-conf", f"last_call_timeout={last_call},keep_alive_interval={keep_alive}", "-m", "hybridpar.cli", *job],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = Stamped(survivor)
    while not listening(port):
        if survivor.poll() is not None:
            raise RuntimeError("the survivor exited before its rendezvous store listened")
        time.sleep(0.05)
    path = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p)
    lost = subprocess.Popen([sys.executable, "-m", "hybridpar.cli", *job, "--nproc", "1", "--rdzv-endpoint",
                             f"127.0.0.1:{port}", "--rdzv-id", "bench"],
                            env={**env, "PYTHONPATH": path, "HYBRIDPAR_FAULT_KILL_NODE_AFTER_STEPS": "3"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while lost.poll() is None:  # the node's death, as close as this process can see it
            time.sleep(0.01)
        died = time.monotonic()
        code = survivor.wait(timeout=1800)
    finally:
        for p in (survivor, lost):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    out.join()
    if log is not None:
        log.write_text("".join(f"{t - died:+9.3f} {line}\n" for t, line in out.lines))
    if code != 0:
        raise RuntimeError(f"the survivor failed ({code}):\n" + "\n".join(x for _, x in out.lines[-40:]))
    failed, _ = out.first(r"failed \(exitcode|Worker group FAILED", died)
    rendezvous, _ = out.first(r"Rendezvous complete|rendezvous.*complet", failed)
    replanned, _ = out.first(r"hybridpar: elastic: the configured", failed)
    resumed, line = out.first(r"resumed from .* \(loaded in", failed)
    load = float(re.search(r"loaded in ([0-9.]+) s", line).group(1))  # type: ignore[union-attr]
    return {"detect_s": failed - died, "rendezvous_s": rendezvous - failed, "start_s": replanned - rendezvous,
            "setup_s": resumed - replanned - load, "load_s": load, "total_s": resumed - died}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,100m")
    ap.add_argument("--last-call", type=int, default=1, help="c10d last_call_timeout of the survivor (s)")
    ap.add_argument("--keep-alive", type=int, default=5, help="c10d keep_alive_interval of the survivor (s)")
    ap.add_argument("--log", type=Path, default=None, help="write the survivor's time-stamped lines here (one per model)")
    args = ap.parse_args()
    from hybridpar.config import load_config

    rows = {}
    for name in args.models.split(","):
        params = load_config(None, MODELS[name]).model.num_params()
        with tempfile.TemporaryDirectory(prefix="hybridpar-elastic-bench-") as tmp:
            log = args.log.with_suffix(f".{name}.log") if args.log else None
            rows[name] = {"params": params, **restart_time(name, args.last_call, args.keep_alive, Path(tmp) / "run", log)}
    print(f"elastic restart after a lost node (2 -> 1 processes; c10d last_call_timeout {args.last_call} s, "
          f"keep_alive_interval {args.keep_alive} s), seconds")
    cols = ["detect_s", "rendezvous_s", "start_s", "setup_s", "load_s", "total_s"]
    print(f"{'model':<6} {'params':>8} " + " ".join(f"{c[:-2]:>10}" for c in cols))
    for name, r in rows.items():
        print(f"{name:<6} {r['params'] / 1e6:>7.1f}M " + " ".join(f"{r[c]:>10.2f}" for c in cols))
    print(json.dumps({"benchmark": "elastic_restart", "last_call_timeout_s": args.last_call,
                      "keep_alive_interval_s": args.keep_alive, "models": rows}))


if __name__ == "__main__":
    main()
