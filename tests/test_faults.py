"""Faults and multi-node launches through torch's own launcher (``torch.distributed.run``).

* A rank killed with SIGKILL under ``torchrun --max-restarts 1``: the job restarts, continues from
  the last complete checkpoint (``train.auto_resume``) and ends bit for bit equal to an
  uninterrupted run of the same layout (weights, optimizer state, per-step losses). The fault
  comes from outside the library: ``tests/faults/sitecustomize.py`` on the workers' ``PYTHONPATH``.
(Two launchers as two nodes: ``tests/test_slurm_example.py``, through the Slurm example.)

Every launcher runs in its own process group, killed on timeout or failure.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from layouts import trainer_for
from test_cli import BASE, losses

from hybridpar.cli import main
from hybridpar.config import load_config
from hybridpar.training.checkpoint import load_model_state, step_dir

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
FAULTS = Path(__file__).parent / "faults"  # a sitecustomize.py: on PYTHONPATH, it injects the fault


def _faults():
    """``tests/faults/sitecustomize.py`` as a plain module (its start-up hook does not run)."""
    spec = importlib.util.spec_from_file_location("hybridpar_test_faults", FAULTS / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FAULT_ENV = _faults().FAULT_ENV


# ----------------------------------------------------------------------------- helpers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, "TORCHELASTIC_RESTART_COUNT")}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


@contextlib.contextmanager
def _launched(cmds: list[list[str]], env: dict[str, str], logs: list[Path]):
    """Start every command in its own session (process group); on leaving, kill what still runs."""
    procs: list[subprocess.Popen] = []
    files = [open(log, "w") for log in logs]  # noqa: SIM115 (closed below)
    try:
        for cmd, f in zip(cmds, files, strict=True):
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in files:
            f.close()


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            pytest.fail(f"launcher {p.args} did not finish within {timeout} s")
    return codes


def _run(cmd: list[str], log: Path, timeout: float = 240, **env: str) -> str:
    with _launched([cmd], _env(**env), [log]) as procs:
        (code,) = _wait(procs, timeout)
    text = log.read_text()
    assert code == 0, text[-4000:]
    return text


def _full_checkpoint(path: Path, tmp: Path) -> dict[str, object]:
    """Every tensor of a checkpoint (model, optimizer, trainer state), flattened to 'a/b/c' keys."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{path.parent.parent.name}-{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    flat: dict[str, object] = {}

    def walk(tree, prefix: str) -> None:
        if isinstance(tree, dict):
            for k, v in tree.items():
                walk(v, f"{prefix}{k}/")
        elif isinstance(tree, list | tuple):
            for i, v in enumerate(tree):
                walk(v, f"{prefix}{i}/")
        else:
            flat[prefix.rstrip("/")] = tree

    walk(torch.load(out, weights_only=False), "")  # our own file, just written
    return flat


# ----------------------------------------------------------------------------- fault injection


def test_fault_spec_names_a_step_and_a_rank_and_fires_on_the_first_attempt_only():
    kill_spec = _faults().kill_spec
    assert kill_spec({}) is None
    assert kill_spec({FAULT_ENV: "5:1"}) == (5, 1)
    assert kill_spec({FAULT_ENV: "5:1", "TORCHELASTIC_RESTART_COUNT": "0"}) == (5, 1)
    assert kill_spec({FAULT_ENV: "5:1", "TORCHELASTIC_RESTART_COUNT": "1"}) is None  # the restart runs through
    with pytest.raises(ValueError, match="must be STEP:RANK"):
        kill_spec({FAULT_ENV: "5"})


def test_injected_fault_kills_the_named_rank_after_the_named_step_returns(monkeypatch):
    faults, kills = _faults(), []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append((pid, sig)))

    class Fake:
        def __init__(self, rank: int) -> None:
            self.topo, self.steps = type("T", (), {"rank": rank})(), []

        def train_step(self, step: int) -> int:
            self.steps.append(step)
            return step * 10

    faults.kill_after_step(Fake, step=5, rank=1)
    other, victim = Fake(0), Fake(1)
    assert [other.train_step(s) for s in range(1, 7)] == [10, 20, 30, 40, 50, 60] and kills == []
    assert victim.train_step(4) == 40 and kills == []
    assert victim.train_step(5) == 50 and victim.steps == [4, 5]  # the step ran, then the kill
    assert kills == [(os.getpid(), signal.SIGKILL)]


def test_max_restarts_inside_an_external_launch_is_rejected(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["train", *BASE, "--max-restarts", "1", "--train.run_dir", str(tmp_path / "r")]) == 2
    assert "pass --max-restarts to torchrun instead" in capsys.readouterr().err


FAULT_ARGS = [*BASE, "--train.steps", "6", "--train.checkpoint_every", "2", "--parallel.dp", "2"]


def _uninterrupted(rank: int, world: int, run_dir: str) -> None:
    cfg = load_config(None, [*FAULT_ARGS, "--train.run_dir", run_dir])
    with trainer_for(cfg) as trainer:
        trainer.fit()


def test_sigkilled_rank_restarts_from_the_last_checkpoint_and_ends_bit_for_bit_equal(tmp_path, dist_run):
    """Rank 1 dies (SIGKILL) right after step 5, one step past the step-4 checkpoint; torchrun
    restarts both ranks, which continue from step 4 and end exactly like an uninterrupted run
    of the same layout (run on the test's worker pool: same code, gloo and thread count)."""
    ref, run = tmp_path / "uninterrupted", tmp_path / "killed"
    dist_run(2, _uninterrupted, str(ref))
    cmd = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "-m", "hybridpar.cli", "train", *FAULT_ARGS, "--train.run_dir", str(run)]
    path = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p)
    text = _run(cmd, tmp_path / "killed.log", **{FAULT_ENV: "5:1", "PYTHONPATH": path})

    # the launcher saw the first attempt fail: rank 1's SIGKILL (-9) or, when rank 0's end-of-step
    # all-reduce noticed the dead peer first, rank 0's exit 1 (which torchrun reports is a race)
    assert "exitcode: -9" in text or "exitcode: 1)" in text, text[-4000:]
    assert f"restart 1 of the job (torchrun --max-restarts): resuming from {step_dir(run, 4)}" in text
    assert f"resumed from {step_dir(run, 4)} at step 4" in text
    # each step logged once; the same data and the same losses, bit for bit (steps 5 and 6 were
    # trained twice: the sampler continued at step 5's global sample ids)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert losses(run) == losses(ref)
    # the final checkpoint: weights, optimizer moments and step counts, trainer state
    _, want = load_model_state(step_dir(ref, 6))
    _, got = load_model_state(step_dir(run, 6))
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    full_ref, full_run = _full_checkpoint(step_dir(ref, 6), tmp_path), _full_checkpoint(step_dir(run, 6), tmp_path)
    assert full_ref.keys() == full_run.keys()
    assert any(k.startswith("optim/state/") and k.endswith("/exp_avg") for k in full_ref)
    for key, value in full_ref.items():
        if key.startswith("rng/"):  # one rank's global RNG (ranks differ; training draws none from it)
            continue
        same = torch.equal(full_run[key], value) if isinstance(value, torch.Tensor) else full_run[key] == value
        assert same, key


def test_restart_after_the_final_checkpoint_has_nothing_left_to_train(tmp_path, monkeypatch, capsys):
    """A rank lost after the last step's checkpoint: the restarted job finds it complete and
    exits 0 without touching the run (instead of refusing the checkpoint as too far along)."""
    run = tmp_path / "r"
    assert main(["train", *BASE, "--train.steps", "2", "--train.run_dir", str(run)]) == 0
    before = (run / "metrics.jsonl").read_text()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    from hybridpar import cli

    cfg = load_config(None, [*BASE, "--train.steps", "2", "--train.run_dir", str(run)])
    assert cli._run_worker(cfg, None, auto_resume=True) == 0
    assert "nothing left to train" in capsys.readouterr().out
    assert (run / "metrics.jsonl").read_text() == before


def test_a_rank_killed_under_hybridpars_max_restarts_is_one_line_naming_it(tmp_path):
    """``hybridpar train --nproc 2 --max-restarts 1``, rank 1 SIGKILLed after step 3: one line
    names the lost rank and its signal (no gloo tracebacks), and the job finishes from its step-2
    in-memory snapshot (on by default under --max-restarts; test_snapshot.py). Without restarts left the same line says the job stops, exit status 1."""
    path = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p)
    args = [*BASE, "--train.steps", "4", "--train.checkpoint_every", "2", "--parallel.dp", "2", "--nproc", "2"]
    cmd = [sys.executable, "-m", "hybridpar.cli", "train", *args, "--max-restarts", "1",
           "--train.run_dir", str(tmp_path / "r")]
    text = _run(cmd, tmp_path / "r.log", **{FAULT_ENV: "3:1", "PYTHONPATH": path})
    lost = [line for line in text.splitlines() if "lost a peer" in line]
    assert lost == ["hybridpar: lost a peer: rank 1 (killed by SIGKILL); the launcher restarts the job from its last "
                    "checkpoint (1 restart left)"], text[-4000:]
    assert "Traceback" not in text and "GLHF" not in text, text[-4000:]
    assert "snapshot-step-00000002 at step 2" in text, text[-4000:]
    cmd = [sys.executable, "-m", "hybridpar.cli", "train", *args, "--train.run_dir", str(tmp_path / "s")]
    with _launched([cmd], _env(**{FAULT_ENV: "3:1", "PYTHONPATH": path}), [tmp_path / "s.log"]) as procs:
        (code,) = _wait(procs, 240)
    text = (tmp_path / "s.log").read_text()
    assert code == 1, text[-4000:]
    lost = [line for line in text.splitlines() if "lost a peer" in line]
    assert lost == ["hybridpar: lost a peer: rank 1 (killed by SIGKILL); no restarts left, the job stops"], text[-4000:]
    assert "Traceback" not in text and "GLHF" not in text, text[-4000:]
