"""Elastic training through real launchers: local nodes of 2 processes each meet over c10d on
127.0.0.1 (``--nnodes 1:2``); a node joins a running job and is later killed, and the job ends
on the same trajectory as one process.

1. The first node starts alone (2 processes: dp2 x tp2 re-planned to tp2) and holds after step 2.
2. The second node joins: torch's agent stops the first node's workers with SIGTERM, they
   checkpoint step 2, and both nodes restart on 4 processes (the configured dp2 x tp2).
3. The second node is killed (agent and workers, SIGKILL) after training 3 steps (step 5, one
   past the step-4 checkpoint); the first node's agent restarts its workers, which re-plan for
   the 2 processes left, load the step-4 checkpoint resharded, redo step 5 and finish.

The first node is ``torchrun --nnodes 1:2`` (it hosts the rendezvous store, as the node at the
endpoint does); the second is ``hybridpar train --elastic 2:4 --nproc 2 --rdzv-endpoint``, the
library's own launcher joining the same job. Both unshare torch's rendezvous store
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; the library's launcher does it itself), without which
step 2 hangs. The faults come from outside the library (``tests/faults/sitecustomize.py``). The
result is compared with the one-process run, which the uninterrupted 4-process run equals
(test_layouts.py); test_elastic.py runs the trajectory comparisons under every kernel
(``numerics``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from layouts import trainer_for
from test_cli import BASE, losses
from test_faults import FAULTS, TORCHRUN, _env, _free_port, _launched, _wait

from hybridpar.config import load_config
from hybridpar.distributed.launch import SHARED_STORE_ENV
from hybridpar.training.checkpoint import load_model_state, step_dir
from hybridpar.training.elastic import history

STEPS = 6
LR = 3e-3
COMMON = [*BASE, "--train.steps", str(STEPS), "--train.checkpoint_every", "2", "--train.lr", str(LR)]
JOB = [*COMMON, "--parallel.dp", "2", "--parallel.tp", "2"]
WEIGHT_ATOL = 0.01 * LR * STEPS  # the invariance matrix's rule (test_layouts.py)


def _reference(run_dir: str) -> None:
    """The same job in one process, uninterrupted."""
    cfg = load_config(None, [*COMMON, "--train.run_dir", run_dir])
    with trainer_for(cfg) as trainer:
        trainer.fit()


def _faults_env(**faults: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p)
    return _env(PYTHONPATH=path, **{SHARED_STORE_ENV: "1"}, **faults)


def _logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_node_joins_then_is_lost_and_the_other_continues_alone_on_the_same_trajectory(tmp_path):
    ref, run = tmp_path / "one", tmp_path / "elastic"
    _reference(str(ref))
    port, job_id = _free_port(), "elastic-test"
    job = ["train", *JOB, "--train.run_dir", str(run), "--elastic", "2:4"]
    first = [*TORCHRUN, "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job_id, "--max-restarts", "2",
             "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1", "-m", "hybridpar.cli", *job]
    second = [sys.executable, "-m", "hybridpar.cli", *job, "--nproc", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
              "--rdzv-id", job_id]
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    with _launched([first], _faults_env(HYBRIDPAR_FAULT_HOLD_AFTER_STEP="2"), logs[:1]) as survivor:
        deadline = time.monotonic() + 120
        while _logged_steps(run) < 1:  # the first node trains alone (and holds after step 2)
            assert time.monotonic() < deadline and survivor[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        with _launched([second], _faults_env(HYBRIDPAR_FAULT_KILL_NODE_AFTER_STEPS="3"), logs[1:]) as lost:
            (code,) = _wait(survivor, 300)
            lost[0].wait(timeout=30)
    text = logs[0].read_text()
    assert code == 0, text[-4000:] + logs[1].read_text()[-3000:]
    assert lost[0].returncode == -9  # the second node's launcher died of the SIGKILL
    # 2 processes, then 4 from the step-2 checkpoint written when the second node joined, then 2
    # again from the step-4 checkpoint once it was lost after step 5
    changes = history(run)
    assert [(c["step"], c["world"], c["layout"]) for c in changes] == [
        (0, 2, "dp1 tp2 pp1 cp1 zero0"), (2, 4, "dp2 tp2 pp1 cp1 zero0"), (4, 2, "dp1 tp2 pp1 cp1 zero0")], changes
    assert "gave up dp=2, kept tp=2" in changes[2]["reason"]
    assert changes[1]["reason"] == "the configured layout (dp=2 x tp=2 x pp=1 x cp=1)"
    assert "hybridpar: elastic: stopped by SIGTERM after step 2" in text  # the agent made room for the new node
    # rank 0 of the 4-process round may sit on either node, so its line may be in either log (the
    # layouts.json history above is the record); after the loss only the first node is left
    assert "elastic: world 2 -> 4 at step 2" in text + logs[1].read_text()
    assert "elastic: world 4 -> 2 at step 4" in text
    assert f"hybridpar: elastic: 2 processes, layout dp1 tp2 pp1 cp1 zero0: resuming from {step_dir(run, 4)}" in text
    # the first node's ranks say in one line each why their collective failed, no traceback
    assert "lost a peer (Connection" in text and "Traceback" not in text, text[-4000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # step 5 once, as redone at 2
    assert [m["world"] for m in metrics] == [2, 2, 4, 4, 2, 2]
    assert json.loads((run / "summary.json").read_text())["layout_changes"] == changes
    assert losses(run) == pytest.approx(losses(ref), rel=1e-5)
    _, got = load_model_state(step_dir(run, STEPS))
    _, want = load_model_state(step_dir(ref, STEPS))
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=WEIGHT_ATOL, msg=lambda m, k=k: f"{k}: {m}")


def test_node_faults_kill_the_agent_after_n_trained_steps_and_hold_until_signalled(monkeypatch):
    from test_faults import _faults

    faults, kills = _faults(), []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    monkeypatch.setattr(faults, "HOLD_LIMIT_S", 5.0)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert faults.step_spec({faults.NODE_FAULT_ENV: "3"}, faults.NODE_FAULT_ENV) == 3
    assert faults.step_spec({faults.NODE_FAULT_ENV: "3", "TORCHELASTIC_RESTART_COUNT": "1"}, faults.NODE_FAULT_ENV) is None

    class Fake:
        def __init__(self) -> None:
            self.stop = type("Stop", (), {"signum": 0})()

        def train_step(self, step: int) -> int:
            return step

    faults.node_faults(Fake, kill_after=3, hold_after=2)
    trainer = Fake()
    assert [trainer.train_step(s) for s in (5, 6)] == [5, 6] and kills == []  # counted, not numbered
    signal_later = threading.Timer(0.2, lambda: setattr(trainer.stop, "signum", 15))  # the agent's SIGTERM
    signal_later.start()
    assert trainer.train_step(2) == 2
    assert trainer.stop.signum == 15  # step 2 returned only once the signal had arrived
    signal_later.join()
    assert kills == [(os.getppid(), 9), (os.getpid(), 9)]  # the third step trained: agent, then itself
