"""Elastic training through real launchers: two local nodes of 2 processes each rendezvous over
c10d on 127.0.0.1 (``--nnodes 1:2``); one node is killed (agent and workers, SIGKILL) after
step 5, one step past the step-4 checkpoint; the other node's agent restarts its workers, which
re-plan the layout for the 2 processes left, load the step-4 checkpoint resharded, redo step 5
and finish on the same trajectory as the uninterrupted 4-process run and the one-process run.
Both launchers unshare torch's rendezvous store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``; the
library's launcher does it itself), without which a node joining a running job hangs.

The surviving node is ``torchrun --nnodes 1:2`` (it hosts the rendezvous store, as the node at
the endpoint does); the lost node is ``hybridpar train --elastic 2:4 --nproc 2
--rdzv-endpoint``, the library's own launcher joining the same job. The fault comes from outside
the library (``tests/faults/sitecustomize.py``, on the lost node's ``PYTHONPATH`` only).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest
import torch
from test_cli import BASE, losses
from test_faults import FAULTS, TORCHRUN, _env, _free_port, _launched, _wait

from hybridpar.config import load_config
from hybridpar.distributed.launch import SHARED_STORE_ENV
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.training.checkpoint import load_model_state, step_dir
from hybridpar.training.elastic import history
from hybridpar.training.trainer import Trainer

pytestmark = pytest.mark.numerics  # results compared across layouts (Makefile: other ATEN_CPU_CAPABILITY too)

STEPS = 6
LR = 3e-3
COMMON = [*BASE, "--train.steps", str(STEPS), "--train.checkpoint_every", "2", "--train.lr", str(LR)]
JOB = [*COMMON, "--parallel.dp", "2", "--parallel.tp", "2"]
WEIGHT_ATOL = 0.01 * LR * STEPS  # the invariance matrix's rule (test_layouts.py)


def _reference(rank: int, world: int, run_dir: str) -> None:
    """The same job uninterrupted: the configured dp2 x tp2 on 4 ranks, or one process."""
    cfg = load_config(None, [*(JOB if world == 4 else COMMON), "--train.run_dir", run_dir])
    with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
        Trainer(cfg, topo).fit()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_node_lost_the_other_continues_alone_on_the_same_trajectory(tmp_path, dist_run):
    ref4, ref1, run = tmp_path / "four", tmp_path / "one", tmp_path / "elastic"
    dist_run(4, _reference, str(ref4))
    _reference(0, 1, str(ref1))
    port, job_id = _free_port(), "elastic-test"
    job = ["train", *JOB, "--train.run_dir", str(run), "--elastic", "2:4"]
    survivor = [*TORCHRUN, "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job_id, "--max-restarts", "2",
                "--rdzv-conf", "last_call_timeout=5", "-m", "hybridpar.cli", *job]
    lost = ["-m", "hybridpar.cli", *job, "--nproc", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job_id]
    lost_env = {"HYBRIDPAR_FAULT_KILL_NODE_AT_STEP": "5",
                "PYTHONPATH": os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p)}
    logs = [tmp_path / "survivor.log", tmp_path / "lost.log"]
    with _launched([survivor], _env(**{SHARED_STORE_ENV: "1"}), logs[:1]) as first:
        deadline = time.monotonic() + 60
        while not _listening(port):  # the survivor's agent hosts the rendezvous store
            assert time.monotonic() < deadline and first[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        with _launched([[sys.executable, *lost]], _env(**lost_env), logs[1:]) as second:
            (code,) = _wait(first, 300)
            second[0].wait(timeout=30)
    text = logs[0].read_text()
    assert code == 0, text[-4000:] + logs[1].read_text()[-3000:]
    assert second[0].returncode == -9  # the lost node's launcher died of the SIGKILL
    # both nodes trained together first, then the survivor alone from the step-4 checkpoint
    # (both nodes normally meet in the first round; on a loaded machine the survivor may start
    # alone on 2 processes and grow to 4 when the other node joins: then one more entry first)
    changes = history(run)
    assert [(c["step"], c["world"], c["layout"]) for c in changes[-2:]] == [
        (changes[-2]["step"], 4, "dp2 tp2 pp1 cp1 zero0"), (4, 2, "dp1 tp2 pp1 cp1 zero0")], changes
    assert changes[0]["step"] == 0 and len(changes) in (2, 3), changes
    assert "gave up dp=2, kept tp=2" in changes[-1]["reason"]
    assert f"hybridpar: elastic: 2 processes, layout dp1 tp2 pp1 cp1 zero0: resuming from {step_dir(run, 4)}" in text
    assert "elastic: world 4 -> 2 at step 4" in text
    # the survivor's ranks say in one line each why their collective failed, no traceback
    assert "lost a peer (Connection" in text and "Traceback" not in text, text[-4000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert [m["world"] for m in metrics][changes[-2]["step"]:] == [4] * (4 - changes[-2]["step"]) + [2, 2]
    assert json.loads((run / "summary.json").read_text())["layout_changes"] == changes
    _, got = load_model_state(step_dir(run, STEPS))
    for ref in (ref4, ref1):
        assert losses(run) == pytest.approx(losses(ref), rel=1e-5)
        _, want = load_model_state(step_dir(ref, STEPS))
        assert got.keys() == want.keys()
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=WEIGHT_ATOL, msg=lambda m, k=k: f"{k}: {m}")
