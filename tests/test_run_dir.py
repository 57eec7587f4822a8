"""The run directory (issue 44): earlier runs are never deleted, one job at a time, a bare
`hybridpar` is help rather than a run, and an unusable run_dir is one line before launch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from hybridpar import __version__, cli
from hybridpar.training.rundir import backup_previous_run, hold_run_dir, lock_path

TINY = ["--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "4", "--model.n_kv_heads", "2",
        "--model.ffn_hidden", "64", "--model.max_seq_len", "64", "--train.seq_len", "32",
        "--train.global_batch", "4", "--train.micro_batch", "2", "--train.steps", "1",
        "--train.eval_every", "0", "--train.sample_tokens", "4"]


def test_every_earlier_run_is_kept_under_a_numbered_backup(tmp_path, capsys):
    """Three runs into one directory: the two earlier ones (checkpoints included) survive as
    run.1 and run.2, oldest first, and the line that moves one names where and what it held."""
    run = tmp_path / "run"
    for lr in ("1e-3", "2e-3", "3e-3"):
        args = ["train", *TINY, "--train.run_dir", str(run), "--train.checkpoint_every", "1", "--train.lr", lr]
        assert cli.main(args) == 0
    for name, lr in (("run.1", 1e-3), ("run.2", 2e-3), ("run", 3e-3)):
        assert (tmp_path / name / "checkpoints" / "step-000001" / "complete.json").exists(), name
        assert f'"lr": {lr}' in (tmp_path / name / "config.json").read_text(), name
    out = capsys.readouterr().out
    assert f"moved the previous run in {run} (1 checkpoint(s), latest step-000001" in out
    assert f"to {tmp_path / 'run.2'}" in out


def test_backup_numbers_only_grow(tmp_path):
    """A gap (the user deleted run.1) never makes a newer backup look older than run.2."""
    for name in ("run.2", "run"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(name)
    assert backup_previous_run(tmp_path / "run") == tmp_path / "run.3"
    assert (tmp_path / "run.3" / "metrics.jsonl").read_text() == "run"
    assert backup_previous_run(tmp_path / "run") is None  # nothing there now


def _holder(run_dir) -> subprocess.Popen:
    """Another process that holds run_dir's lock until killed; returns once it holds it."""
    code = ("import sys, time; from hybridpar.training.rundir import hold_run_dir\n"
            "with hold_run_dir(sys.argv[1], 'hybridpar train --other-job'):\n"
            "    print('held', flush=True); time.sleep(600)\n")
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDPAR_RUN_DIR_LOCK"}
    proc = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_job_is_refused_naming_the_holder_and_a_dead_holder_blocks_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        assert cli.main(["train", *TINY, "--train.run_dir", str(run)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert f"train.run_dir {run} is in use by a running job (pid {holder.pid} on " in err
        assert "hybridpar train --other-job" in err and "choose another --train.run_dir" in err
        assert not run.exists()  # the live job's directory was not touched
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert str(holder.pid) in lock_path(run).read_text()  # the dead job's lock file is still there
    assert cli.main(["train", *TINY, "--train.run_dir", str(run)]) == 0  # ... and blocks nothing


def test_the_lock_is_held_for_the_job_and_released_after(tmp_path, monkeypatch):
    """Inside the job a second holder is refused; after it, the lock is free again."""
    from hybridpar.training.rundir import LOCK_HELD_ENV, RunDirBusy

    with hold_run_dir(tmp_path / "run", "first"):
        monkeypatch.delenv(LOCK_HELD_ENV)  # as another process would see it
        with pytest.raises(RunDirBusy, match="first"), hold_run_dir(tmp_path / "run"):
            pass
    with hold_run_dir(tmp_path / "run"):
        pass


def test_bare_hybridpar_prints_the_commands_and_trains_nothing(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "train", (lambda argv: pytest.fail("a bare hybridpar must not train"), "x"))
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hybridpar {train,")
    assert "  plan  " in out and "`hybridpar train` with no arguments trains the built-in demo" in out


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hybridpar {__version__}"


def test_train_help_lists_every_config_key_with_its_default(capsys):
    import dataclasses

    from hybridpar.config import Config

    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    cfg = Config()
    for section in ("model", "parallel", "train"):
        assert f"  [{section}]" in out
        for f in dataclasses.fields(getattr(cfg, section)):
            assert f"{f.name}={getattr(getattr(cfg, section), f.name)!r}" in out, f"{section}.{f.name}"


@pytest.mark.parametrize("where", ["file", "readonly"])
def test_an_unusable_run_dir_is_one_line_and_exit_2_before_launch(tmp_path, capsys, monkeypatch, where):
    """A run_dir under a file, or on a read-only mount (simulated: root ignores permission bits),
    is refused in one line naming it; nothing is launched."""
    from hybridpar.distributed import launch

    monkeypatch.setattr(launch, "launch_local", lambda *a, **kw: pytest.fail("launched"))
    if where == "file":
        (tmp_path / "f").write_text("")
        run = tmp_path / "f" / "run"
    else:
        run = tmp_path / "ro" / "run"
        (tmp_path / "ro").mkdir()
        import tempfile

        def read_only(*a, **kw):
            raise OSError(30, "Read-only file system")

        monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    assert cli.main(["train", *TINY, "--nproc", "2", "--parallel.dp", "2", "--train.run_dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"train.run_dir {run}" in err and "--train.run_dir DIR" in err
    assert ("is not a directory" if where == "file" else "is not writable (Read-only file system)") in err


def test_a_flight_record_into_an_unusable_run_dir_is_skipped_not_raised(tmp_path):
    from hybridpar.distributed import flight
    from hybridpar.distributed.comm import CommCounter

    (tmp_path / "f").write_text("")
    assert flight.dump(CommCounter(), tmp_path / "f" / "run", 0, "test") is None
    assert flight.dump(CommCounter(), tmp_path / "ok", 0, "test") == tmp_path / "ok" / "flight" / "rank-0.json"


def test_a_resumed_run_keeps_the_runs_first_loss_and_adds_the_segments(tmp_path):
    """summary.json's first_loss is step 1's (metrics.jsonl) after --resume, not the resumed
    segment's first step; the segment's first step and loss are added."""
    import json
    import shutil

    from hybridpar.training.checkpoint import step_dir

    run = tmp_path / "r"
    args = ["train", *TINY, "--train.steps", "4", "--train.log_every", "1", "--train.run_dir", str(run),
            "--train.checkpoint_every", "2"]
    assert cli.main(args) == 0
    whole = json.loads((run / "summary.json").read_text())
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert whole["first_loss"] == metrics[0]["loss"] and metrics[0]["step"] == 1
    shutil.rmtree(step_dir(run, 4))
    assert cli.main([*args, "--resume"]) == 0
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["first_loss"] == whole["first_loss"]
    assert resumed["segment_first_step"] == 3 and resumed["segment_first_loss"] == metrics[2]["loss"]
    assert resumed["final_loss"] == whole["final_loss"]
