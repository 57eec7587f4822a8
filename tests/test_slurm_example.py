"""``examples/slurm/train.sbatch``, run as it is with stand-ins for ``srun`` and ``scontrol``:
two "nodes" on 127.0.0.1, one torchrun each, c10d rendezvous.

* The two launchers train dp2 x tp2 together: tp groups stay inside a node, and the result equals
  the single-process run.
* SIGTERM to the batch script (Slurm's ``--signal=B:TERM``, or preemption): every rank saves a
  complete checkpoint, the job requeues itself, and the requeued job resumes and ends exactly like
  a run that was never stopped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch
from test_cli import BASE, losses
from test_lifecycle import LONG, _uninterrupted, _wait_for_step, session

from hybridpar.cli import main
from hybridpar.training.checkpoint import is_complete, load_model_state, step_dir

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"

SRUN = textwrap.dedent("""\
    #!/usr/bin/env bash
    # srun stand-in: run the command once per node (SLURM_NODEID), forward SIGTERM to them all.
    while [[ "$1" == --* ]]; do shift; done
    pids=()
    for ((node = 0; node < SLURM_NNODES; node++)); do
      SLURM_NODEID=$node "$@" &
      pids+=($!)
    done
    trap 'kill -TERM "${pids[@]}" 2> /dev/null' TERM
    status=0
    for pid in "${pids[@]}"; do
      while true; do
        wait "$pid"; code=$?
        kill -0 "$pid" 2> /dev/null || break  # wait was cut short by the trap: wait again
      done
      [ "$code" -gt "$status" ] && status=$code
    done
    exit "$status"
""")

SCONTROL = textwrap.dedent("""\
    #!/usr/bin/env bash
    # scontrol stand-in: every node is this machine; requeue is recorded.
    case "$1 $2" in
      "show hostnames") echo 127.0.0.1 ;;
      requeue*) echo "requeue $2" >> "$STUB_LOG" ;;
    esac
""")

# Loaded by every Python process of the job (PYTHONPATH): each rank records where it sits.
PLACEMENT = textwrap.dedent("""\
    import os
    if os.environ.get("PLACEMENT_DIR") and os.environ.get("RANK"):
        import json
        from pathlib import Path
        from hybridpar.training.trainer import Trainer

        real = Trainer.fit

        def fit(self, resume=None):
            record = {"rank": self.topo.rank, "tp": list(self.topo.tp.ranks), "dp": list(self.topo.dp.ranks),
                      "group_rank": int(os.environ["GROUP_RANK"]), "local_rank": int(os.environ["LOCAL_RANK"]),
                      "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]), "agent": os.getppid()}
            (Path(os.environ["PLACEMENT_DIR"]) / f"rank-{self.topo.rank}.json").write_text(json.dumps(record))
            return real(self, resume)

        Trainer.fit = fit
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp: Path, run_dir: Path, args: list[str], nproc: int, **extra: str) -> dict[str, str]:
    stubs = tmp / "stubs"
    stubs.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("sitecustomize.py", PLACEMENT)):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    bin_dir = Path(os.sys.executable).parent
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))},
            "PATH": f"{stubs}:{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(stubs),
            "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "hybridpar",
            "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "NPROC_PER_NODE": str(nproc),
            "PORT": str(_free_port()), "RUN_DIR": str(run_dir), "HYBRIDPAR_ARGS": " ".join(args),
            "STUB_LOG": str(tmp / "stub.log"), **extra}


def _sbatch(env: dict[str, str], log: Path):
    return session(["bash", str(SBATCH)], env, log)


def _finish(p: subprocess.Popen, log: Path, timeout: float = 240) -> int:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the batch script did not finish within {timeout} s:\n{log.read_text()[-4000:]}")


NODE_ARGS = [*BASE, "--train.steps", "4", "--train.checkpoint_every", "0"]


def test_two_nodes_train_dp2_tp2_like_one_process(tmp_path):
    ref, run = tmp_path / "one", tmp_path / "nodes"
    assert main(["train", *NODE_ARGS, "--train.run_dir", str(ref)]) == 0
    placement = tmp_path / "placement"
    placement.mkdir()
    env = _env(tmp_path, run, [*NODE_ARGS, "--parallel.dp", "2", "--parallel.tp", "2"], 2,
               PLACEMENT_DIR=str(placement))
    log = tmp_path / "job.log"
    with _sbatch(env, log) as p:
        assert _finish(p, log) == 0, log.read_text()[-4000:]

    ranks = {r["rank"]: r for r in (json.loads(f.read_text()) for f in placement.glob("rank-*.json"))}
    assert sorted(ranks) == [0, 1, 2, 3]
    agents = {r["agent"] for r in ranks.values()}
    assert len(agents) == 2  # two torchruns ("nodes"), two ranks each
    for r in ranks.values():
        assert r["local_world_size"] == 2
        assert r["rank"] == 2 * r["group_rank"] + r["local_rank"]  # a node's ranks are consecutive
        # tp (innermost) stays inside the node; dp spans the two nodes
        assert {ranks[t]["agent"] for t in r["tp"]} == {r["agent"]} and len(r["tp"]) == 2
        assert {ranks[d]["agent"] for d in r["dp"]} == agents and len(r["dp"]) == 2
    assert losses(run) == pytest.approx(losses(ref), rel=1e-5)  # fp32: only summation order differs
    assert main(["compare", str(ref), str(run)]) == 0  # weights within the documented tolerance


def test_preempted_job_saves_requeues_and_resumes_bit_for_bit(tmp_path, dist_run):
    run, ref = tmp_path / "run", tmp_path / "ref"
    args = [a for a in LONG]  # dp2 over two nodes of one process each
    env = _env(tmp_path, run, args, 1)
    log = tmp_path / "job.log"
    with _sbatch(env, log) as p:
        _wait_for_step(run, 3, p, log)
        time.sleep(0.1)
        p.send_signal(signal.SIGTERM)  # Slurm's --signal=B:TERM reaches the batch shell
        assert _finish(p, log) == 0, log.read_text()[-4000:]
    assert (tmp_path / "stub.log").read_text() == "requeue 4242\n"
    saved = [d for d in (run / "checkpoints").iterdir() if is_complete(d)]
    assert len(saved) == 1 and int(saved[0].name.split("-")[1]) < 200, log.read_text()[-4000:]

    env["PORT"] = str(_free_port())
    with _sbatch(env, log) as p:  # the requeued job
        assert _finish(p, log) == 0, log.read_text()[-4000:]
    assert "resumes from the newest checkpoint" in log.read_text()
    dist_run(2, _uninterrupted, str(ref))
    assert losses(run) == losses(ref)
    _, want = load_model_state(step_dir(ref, 200))
    _, got = load_model_state(step_dir(run, 200))
    assert all(torch.equal(got[k], v) for k, v in want.items())
