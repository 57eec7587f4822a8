"""A job's life through the local launcher (``hybridpar train --nproc N``): preemption by signal,
a second signal, a SIGKILLed launcher, a worker's user error, and the 3D layout's exit.

Every launch runs in a session of its own and is killed on leaving, so a failing test leaves
no process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from layouts import trainer_for
from test_cli import BASE, losses

from hybridpar.config import load_config
from hybridpar.distributed import lifecycle
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.training.checkpoint import is_complete, load_model_state, step_dir

LONG = [*BASE, "--train.steps", "200", "--train.checkpoint_every", "0", "--parallel.dp", "2"]
CLI = [sys.executable, "-m", "hybridpar.cli"]


@contextlib.contextmanager
def session(cmd: list[str], env: dict[str, str], log: Path):
    """``cmd`` in a session of its own, output appended to ``log``; the session is killed on leaving."""
    with open(log, "a") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            yield p
        finally:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@contextlib.contextmanager
def _launch(args: list[str], log: Path):
    """``hybridpar train ARGS``; on leaving, its session and any worker left are killed."""
    try:
        with session([*CLI, "train", *args], {**os.environ, "OMP_NUM_THREADS": "1"}, log) as p:
            yield p
    finally:
        for pid in _workers(args):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _workers(args: list[str]) -> list[int]:
    """Live worker processes of a launch: their command line carries the launch's run_dir
    argument but not --nproc (the launcher's does)."""
    run_dir = args[args.index("--train.run_dir") + 1].encode()
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            state = next((ln for ln in (proc / "status").read_text().splitlines() if ln.startswith("State:")), "")
        except OSError:
            continue
        if b"hybridpar.cli" in cmd and run_dir in cmd and b"--nproc" not in cmd and "zombie" not in state:
            out.append(int(proc.name))
    return out


def _wait_for_step(run: Path, step: int, p: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert p.poll() is None, log.read_text()[-3000:]
        with contextlib.suppress(OSError, json.JSONDecodeError, IndexError):
            lines = (run / "metrics.jsonl").read_text().splitlines()
            if lines and json.loads(lines[-1])["step"] >= step:
                return
        time.sleep(0.05)
    pytest.fail(f"no step {step} within {timeout} s:\n{log.read_text()[-3000:]}")


def _exit_of(p: subprocess.Popen, log: Path, timeout: float = 120) -> int:
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the launcher did not exit within {timeout} s:\n{log.read_text()[-3000:]}")


def _uninterrupted(rank: int, world: int, run_dir: str) -> None:
    cfg = load_config(None, [*LONG, "--train.run_dir", run_dir])
    with trainer_for(cfg) as trainer:
        trainer.fit()


# ----------------------------------------------------------------------------- pieces


def _agree_worker(rank: int, world: int) -> int:
    with ParallelDims(dp=world).build("cpu") as topo:
        stop = lifecycle.StopRequest()
        before = stop.agreed(topo.world, torch.device("cpu"))
        if rank == 1:
            stop.request(signal.SIGTERM)  # as the handler would
        return before * 1000 + stop.agreed(topo.world, torch.device("cpu"))


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(dist_run):
    assert dist_run(2, _agree_worker) == [int(signal.SIGTERM)] * 2


def test_second_signal_exits_at_once_with_128_plus_n():
    code = textwrap.dedent("""
        import os, signal, time
        from hybridpar.distributed.lifecycle import StopRequest
        with StopRequest().installed() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            print("first:", stop.signum, flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            print("not reached", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert f"first: {int(signal.SIGINT)}" in proc.stdout and "not reached" not in proc.stdout
    assert "second SIGINT: stopping now" in proc.stderr


def test_resume_command_is_the_users_command_with_resume(monkeypatch):
    monkeypatch.setenv(lifecycle.COMMAND_ENV, "hybridpar train --nproc 2 --resume /old --train.steps 9")
    assert lifecycle.resume_command(Path("/r/checkpoints/step-000003")) == \
        "hybridpar train --nproc 2 --train.steps 9 --resume /r/checkpoints/step-000003"
    monkeypatch.setenv(lifecycle.COMMAND_ENV, "hybridpar train --resume --train.steps 9")
    assert lifecycle.resume_command(Path("/c")) == "hybridpar train --train.steps 9 --resume /c"


# ----------------------------------------------------------------------------- whole jobs


def test_sigterm_to_the_launcher_checkpoints_and_resume_is_bit_for_bit(tmp_path, dist_run):
    """SIGTERM mid-run: every rank finishes its step, one complete checkpoint, the resume command
    printed, exit 143, no worker left; that command then ends exactly like a run never stopped."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    args, log = [*LONG, "--nproc", "2", "--train.run_dir", str(run)], tmp_path / "run.log"
    with _launch(args, log) as p:
        _wait_for_step(run, 3, p, log)
        p.send_signal(signal.SIGTERM)
        assert _exit_of(p, log) == 128 + signal.SIGTERM, log.read_text()[-3000:]
        assert _workers(args) == []
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    (line,) = [ln for ln in text.splitlines() if "resume with: " in ln]
    command = shlex.split(line.split("resume with: ", 1)[1])
    stopped = Path(command[-1])
    assert command[:2] == ["hybridpar", "train"] and command[-2] == "--resume" and is_complete(stopped)
    step = int(stopped.name.split("-")[1])
    assert 3 <= step < 200 and f"stopped by SIGTERM after step {step}" in text
    assert text.count("stopped by SIGTERM") == 1, text[-3000:]  # the launcher does not say it again

    proc = subprocess.run([*CLI, *command[1:]], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    dist_run(2, _uninterrupted, str(ref))
    assert losses(run) == losses(ref)
    _, want = load_model_state(step_dir(ref, 200))
    _, got = load_model_state(step_dir(run, 200))
    assert all(torch.equal(got[k], v) for k, v in want.items())


def test_sigterm_to_one_worker_stops_the_job_with_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    args, log = [*LONG, "--nproc", "2", "--train.run_dir", str(run)], tmp_path / "run.log"
    with _launch(args, log) as p:
        _wait_for_step(run, 2, p, log)
        os.kill(max(_workers(args)), signal.SIGTERM)
        assert _exit_of(p, log) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    text = log.read_text()
    assert "resume with: " in text and "Traceback" not in text, text[-3000:]
    assert [p.name for p in (run / "checkpoints").iterdir() if is_complete(p)]


def test_sigkilled_launcher_takes_its_workers_along(tmp_path):
    run = tmp_path / "run"
    args, log = [*LONG, "--nproc", "2", "--train.run_dir", str(run)], tmp_path / "run.log"
    with _launch(args, log) as p:
        _wait_for_step(run, 2, p, log)
        assert len(_workers(args)) == 2
        p.kill()
        p.wait()
        deadline = time.monotonic() + 10
        while _workers(args) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _workers(args) == []


def test_user_error_in_the_workers_is_one_line_and_exit_2(tmp_path):
    """A corrupt checkpoint found by the workers: the launcher prints the message once, no
    traceback, exit status 2."""
    from hybridpar.cli import main

    run = tmp_path / "run"
    assert main(["train", *BASE, "--train.steps", "2", "--train.run_dir", str(run)]) == 0
    ckpt = step_dir(run, 2)
    shard = next(ckpt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    args = [*BASE, "--train.steps", "4", "--parallel.dp", "2", "--nproc", "2", "--train.run_dir", str(run),
            "--resume", str(ckpt)]
    log = tmp_path / "resume.log"
    with _launch(args, log) as p:
        assert _exit_of(p, log) == 2
    text = log.read_text()
    errors = [ln for ln in text.splitlines() if ln.startswith("hybridpar: error:")]
    assert len(errors) == 1 and "checksum" in errors[0], text[-3000:]
    assert "Traceback" not in text and "ChildFailedError" not in text, text[-3000:]


def test_the_3d_demo_layout_exits_cleanly(tmp_path):
    """dp2 x tp2 x pp2 on 8 processes ends with exit 0 and everything written (the layout whose
    interpreter teardown used to abort; benchmarks/soak.py repeats it 50 times)."""
    run = tmp_path / "run"
    args = [*BASE, "--train.steps", "2", "--train.global_batch", "8", "--train.micro_batch", "2",
            "--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2", "--nproc", "8",
            "--train.run_dir", str(run)]
    log = tmp_path / "run.log"
    with _launch(args, log) as p:
        assert _exit_of(p, log, timeout=240) == 0, log.read_text()[-3000:]
    assert (run / "summary.json").is_file() and (run / "sample.txt").is_file()
    assert "terminate called" not in log.read_text()


def test_a_failure_every_rank_raised_together_is_printed_once(tmp_path, capsys, monkeypatch):
    """A checkpoint write that failed on every rank (a full disk) reaches the launcher once per
    rank, each rank's message naming its own shard: it prints one, the rank's own error over a
    rank that only learned of another's, with its exit status."""
    from hybridpar.distributed.launch import _report_failure
    from hybridpar.distributed.lifecycle import report_error

    monkeypatch.setenv("HYBRIDPAR_ERROR_DIR", str(tmp_path))
    report_error(0, "error", "checkpoint c does not fit on the disk: ... __0_0.distcp", agreed=2)
    report_error(1, "error", "checkpoint c does not fit on the disk: ... __1_0.distcp", agreed=2)
    report_error(2, "error", "checkpoint c was not saved: rank 1 could not write it", agreed=1)
    report_error(3, "error", "data shard x is missing")  # not agreed: printed as well
    assert _report_failure(tmp_path, tmp_path / "run", {0: 1, 1: 1, 2: 1, 3: 1}) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["hybridpar: error: checkpoint c does not fit on the disk: ... __0_0.distcp",
                   "hybridpar: error: data shard x is missing"], err
