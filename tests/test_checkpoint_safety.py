"""Checkpoints that survive crashes and full disks (issue 16): a kill at any file operation of a
save never leaves a checkpoint that ``--resume`` would pick half-written; a full disk is one
line and leaves the previous checkpoint; retention; corrupt checkpoints are skipped by
auto-resume; misleading directories get a diagnosis; published modes follow the umask.

Saves here call :func:`checkpoint.save` directly on a tiny model in one process (no training),
so the whole file runs in seconds."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import time
from pathlib import Path

import pytest
import torch
from layouts import SMALL

from hybridpar.cli import main
from hybridpar.config import ConfigError, load_config
from hybridpar.data.tokenizer import ByteTokenizer
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.errors import UserError
from hybridpar.models.llama import Llama
from hybridpar.parallel.zero import ZeroOptimizer, decay_groups
from hybridpar.training import checkpoint
from hybridpar.training.checkpoint import CheckpointError, manifest, writer
from hybridpar.training.elastic import agreed_latest_checkpoint


class Tiny:
    """One tiny model + optimizer + world-size-1 topology, saved under any run dir."""

    def __init__(self) -> None:
        self.cfg = load_config(None, [*SMALL, "--train.run_dir", "unused"])
        self.topo = ParallelDims.from_config(self.cfg.parallel).build("cpu")
        torch.manual_seed(0)
        self.model = Llama(self.cfg.model)
        self.opt = ZeroOptimizer(decay_groups(self.model, 0.0), self.topo.dp_cp, stage=0)

    def config(self, run: Path, keep: int = 0):
        return load_config(None, [*SMALL, "--train.run_dir", str(run), "--train.keep_checkpoints", str(keep)])

    def save(self, run: Path, step: int, keep: int = 0, tokenizer=None) -> Path:
        return checkpoint.save(checkpoint.step_dir(run, step), self.model, self.opt, self.config(run, keep), step,
                               self.topo, tokenizer)


@pytest.fixture(scope="module")
def tiny() -> Tiny:
    return Tiny()


def steps(run: Path) -> list[int]:
    """Steps of the complete checkpoints under ``run`` (whatever their state)."""
    return sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step-*") if checkpoint.is_complete(p))


def leftovers(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".old-", ".del-")))


# ----------------------------------------------------------------------------- kills during a save

KILLED = 77
OPS = ("fsync", "rename", "replace", "unlink", "rmdir")  # every step of a save that touches the disk


def save_in_child(tiny: Tiny, run: Path, step: int, keep: int, kill_at: int) -> tuple[int, int]:
    """Fork a child that saves ``step``; its ``kill_at``-th file operation (0: none) is
    ``os._exit`` instead, like a SIGKILL of the whole job at that moment. The hook is installed
    in the child only, from here: production code has no fault switch. Returns (exit status,
    operations counted)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(r)
            torch.set_num_threads(1)
            count = [0]

            def hook(real):
                def op(*args, **kwargs):
                    count[0] += 1
                    if count[0] == kill_at:
                        os._exit(KILLED)
                    return real(*args, **kwargs)
                return op

            for name in OPS:
                setattr(os, name, hook(getattr(os, name)))
            tiny.save(run, step, keep)
            os.write(w, str(count[0]).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the saving child (kill at {kill_at}) hung")
        time.sleep(0.01)
    with os.fdopen(r) as f:
        counted = f.read()
    return os.waitstatus_to_exitcode(status), int(counted or 0)


def check_never_half(run: Path, allowed: set[int]) -> int:
    """What --resume would pick is whole (every checksum) and one of ``allowed``; so is every
    other ``step-*`` with a complete.json. Returns the picked step."""
    latest = checkpoint.latest_checkpoint(run)
    verified, skipped = checkpoint.latest_verified_checkpoint(run)
    assert skipped == [] and latest == verified, (latest, verified, skipped)
    for p in (run / "checkpoints").glob("step-*"):
        if checkpoint.is_complete(p):
            checkpoint.require_complete(p)
    step = checkpoint.read_info(latest)["step"]
    assert step in allowed, (step, allowed)
    return step


@pytest.mark.parametrize("scenario", ["new step with retention", "re-save of an existing step"])
def test_a_kill_at_any_file_operation_of_a_save_leaves_a_whole_checkpoint(tiny, tmp_path, scenario):
    base = tmp_path / "base"
    tiny.save(base, 1)
    tiny.save(base, 2)
    step, keep = (3, 2) if scenario.startswith("new") else (2, 0)
    probe = tmp_path / "probe"
    shutil.copytree(base, probe)
    status, ops = save_in_child(tiny, probe, step, keep, kill_at=0)
    assert status == 0 and ops >= 10, (status, ops)  # shards, metadata, config, manifest, renames...
    assert steps(probe) == ([2, 3] if keep else [1, 2]) and leftovers(probe) == []
    for k in range(1, ops + 1):
        run = tmp_path / f"k{k}"
        shutil.copytree(base, run)
        status, _ = save_in_child(tiny, run, step, keep, kill_at=k)
        assert status == KILLED, (k, status)
        # killed mid-save: --resume picks the previous checkpoint or the new one, never a half;
        # a re-save killed between moving step-2 aside and renaming the new one in shows step 1
        check_never_half(run, {2, 3} if keep else {1, 2})
        checkpoint.recover(run)  # what the next save or auto-resume does first: step 2 is back
        check_never_half(run, {2, 3} if keep else {2})
        if k % 4 == 0:  # the next save completes and tidies every leftover
            tiny.save(run, 4, keep=2)
            assert leftovers(run) == [] and steps(run)[-1] == 4 and len(steps(run)) == 2
        shutil.rmtree(run)


def test_resave_keeps_the_old_checkpoint_until_the_new_one_is_in(tiny, tmp_path, monkeypatch):
    """The failure of issue 16: a kill between removing step-N and renaming the new one in."""
    run = tmp_path / "r"
    tiny.save(run, 6)
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt("killed")))
    with pytest.raises(KeyboardInterrupt):
        tiny.save(run, 6)
    monkeypatch.setattr(os, "replace", real)
    assert leftovers(run) == [".old-step-000006", ".tmp-step-000006"]
    assert checkpoint.latest_checkpoint(run) is None  # nothing half-written is picked
    assert checkpoint.resolve_resume("latest", run).name == "step-000006"  # put back by recover
    checkpoint.require_complete(checkpoint.step_dir(run, 6))
    tiny.save(run, 6)
    assert leftovers(run) == []


def test_half_checkpoint_with_complete_json_is_never_picked(tiny, tmp_path):
    """step-N with complete.json and .metadata but no shard (the old non-atomic re-save)."""
    run = tmp_path / "r"
    tiny.save(run, 5)
    half = tiny.save(run, 6)
    (half / "__0_0.distcp").unlink()
    assert checkpoint.latest_checkpoint(run).name == "step-000005"
    assert checkpoint.latest_verified_checkpoint(run)[0].name == "step-000005"
    with pytest.raises(CheckpointError, match=r"is missing __0_0.distcp.* earlier complete checkpoint .*step-000005"):
        checkpoint.resolve_resume(str(half), run)


# ----------------------------------------------------------------------------- full disk


def test_a_checkpoint_that_does_not_fit_is_refused_before_writing(tiny, tmp_path, monkeypatch):
    run = tmp_path / "r"
    first = tiny.save(run, 5)
    monkeypatch.setattr(writer, "free_bytes", lambda folder: 4096)
    with pytest.raises(CheckpointError) as e:
        tiny.save(run, 10)
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, UserError)
    assert f"not enough disk space for checkpoint {run / 'checkpoints' / 'step-000010'}: it needs about " in msg
    assert f"{run / 'checkpoints'} has 4096 bytes (0.0 MiB) free" in msg
    assert leftovers(run) == [] and steps(run) == [5]
    checkpoint.require_complete(first)


@pytest.mark.parametrize("where", ["shard (ENOSPC)", "shard (torch's short write)", "complete.json", "shard (EACCES)"])
def test_disk_full_during_the_write_is_one_line_and_keeps_the_previous(tiny, tmp_path, monkeypatch, where):
    run = tmp_path / "r"
    first = tiny.save(run, 5)
    if where == "complete.json":
        real = manifest.write_durable

        def write(path, text):
            if path.name == checkpoint.COMPLETE:
                raise OSError(errno.ENOSPC, "No space left on device")
            real(path, text)

        monkeypatch.setattr(manifest, "write_durable", write)
    else:
        from torch.distributed.checkpoint import filesystem

        error = (OSError(errno.ENOSPC, "No space left on device") if "ENOSPC" in where else
                 OSError(errno.EACCES, "Permission denied") if "EACCES" in where else
                 RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"))

        def write_item(*args, **kwargs):
            raise error

        monkeypatch.setattr(filesystem, "_write_item", write_item)
    with pytest.raises(CheckpointError) as e:
        tiny.save(run, 10)
    msg = str(e.value)
    assert "\n" not in msg, msg
    if "EACCES" in where:  # not a full disk: said as it is
        assert msg.startswith(f"checkpoint {run / 'checkpoints' / 'step-000010'} could not be written: "
                              "PermissionError: [Errno 13] Permission denied; the previous checkpoints are intact"), msg
    else:
        assert f"checkpoint {run / 'checkpoints' / 'step-000010'} does not fit on the disk: it needs about " in msg
        assert "free" in msg and "the previous checkpoints are intact" in msg
    assert leftovers(run) == [] and steps(run) == [5]
    checkpoint.require_complete(first)


def test_cli_prints_the_disk_full_error_as_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(writer, "free_bytes", lambda folder: 1000)
    run = tmp_path / "r"
    assert main(["train", *SMALL, "--train.run_dir", str(run), "--train.steps", "1", "--train.eval_every", "0"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line.lower()]  # the rest is the progress bar
    assert len(errors) == 1 and "Traceback" not in err, err
    # (the trainer leaves its progress bar unterminated, so the error may follow it on its line)
    assert "hybridpar: error: not enough disk space for checkpoint" in errors[0], errors
    assert "has 1000 bytes (0.0 MiB) free" in errors[0]
    assert leftovers(run) == []


# ----------------------------------------------------------------------------- retention


def test_keep_checkpoints_deletes_older_ones_after_a_newer_is_complete(tiny, tmp_path):
    run = tmp_path / "r"
    for s in range(1, 5):
        tiny.save(run, s, keep=2)
        assert steps(run) == list(range(max(1, s - 1), s + 1))
    assert leftovers(run) == []
    tiny.save(run, 5, keep=1)
    assert steps(run) == [5]
    tiny.save(run, 6)  # 0 keeps all
    tiny.save(run, 7)
    assert steps(run) == [5, 6, 7]
    tiny.save(run, 3, keep=2)  # resumed from an earlier step: newer steps are not this save's to delete
    assert steps(run) == [3, 5, 6, 7]
    with pytest.raises(ConfigError, match=r"train.keep_checkpoints = -1 must be >= 0"):
        load_config(None, ["--train.keep_checkpoints", "-1"])


# ----------------------------------------------------------------------------- corrupt checkpoints


def corrupt(ckpt: Path) -> None:
    """Flip one byte of the shard: same size, wrong checksum."""
    shard = ckpt / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def test_auto_resume_skips_a_corrupt_latest_checkpoint_and_says_why(tiny, tmp_path, capsys):
    run = tmp_path / "r"
    good = tiny.save(run, 4)
    bad = tiny.save(run, 8)
    corrupt(bad)
    found, skipped = checkpoint.latest_verified_checkpoint(run)
    assert found == good and [p for p, _ in skipped] == [bad]
    assert "__0_0.distcp does not match its checksum" in skipped[0][1]
    assert "(the size is right, " in skipped[0][1] and "the sha256 differs)" in skipped[0][1]  # not "N, expected N"
    assert checkpoint.resolve_resume("latest", run) == good
    assert "skipping checkpoint file" in capsys.readouterr().err
    assert agreed_latest_checkpoint(tiny.topo, run, None) == good
    out = capsys.readouterr().out
    assert f"skipping checkpoint file {bad / '__0_0.distcp'} does not match its checksum" in out
    assert f"resuming from {good}" in out
    # an explicit --resume to the corrupt one stays refused, naming the one to use
    with pytest.raises(CheckpointError) as e:
        checkpoint.require_complete(bad)
    assert "does not match its checksum" in str(e.value)
    assert str(e.value).endswith(f"it is corrupt — resume from the earlier complete checkpoint {good} (--resume {good})")
    corrupt(good)
    with pytest.raises(CheckpointError, match=r"no complete checkpoint under .* \(newest: checkpoint file"):
        checkpoint.resolve_resume("latest", run)


def test_complete_json_is_checked_before_anything_loads(tiny, tmp_path):
    ckpt = tiny.save(tmp_path / "r", 3)
    info = json.loads((ckpt / "complete.json").read_text())
    del info["step"]
    (ckpt / "complete.json").write_text(json.dumps(info))
    with pytest.raises(CheckpointError, match="complete.json has no 'step'; it was not written by hybridpar"):
        checkpoint.load_model_state(ckpt)
    with pytest.raises(CheckpointError, match="has no 'step'"):
        checkpoint.load(ckpt, tiny.model, tiny.opt, tiny.cfg, tiny.topo)
    (ckpt / "complete.json").write_text(json.dumps({**info, "step": "three"}))
    with pytest.raises(CheckpointError, match='has step = "three", not a step number'):
        checkpoint.read_info(ckpt)
    assert checkpoint.latest_checkpoint(tmp_path / "r") is None


def test_generate_on_a_checkpoint_whose_config_does_not_describe_its_weights(tiny, tmp_path, capsys):
    ckpt = tiny.save(tmp_path / "r", 3)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model"]["ffn_hidden"] = 96
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", "--checkpoint", str(ckpt)]) == 2  # the manifest catches the edit
    assert "config.json does not match its checksum" in capsys.readouterr().err
    info = json.loads((ckpt / "complete.json").read_text())
    del info["files"]["config.json"]  # as in a checkpoint whose manifest covered the shards only
    (ckpt / "complete.json").write_text(json.dumps(info))
    assert main(["generate", "--checkpoint", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"checkpoint {ckpt} could not be loaded: " in err[0], err
    assert "its config.json may not describe its weights" in err[0]


# ----------------------------------------------------------------------------- wrong directories


def test_resume_of_a_run_or_hugging_face_directory_says_what_to_pass(tiny, tmp_path, capsys):
    run = tmp_path / "r"
    ckpt = tiny.save(run, 3)
    train = ["train", *SMALL, "--train.run_dir", str(tmp_path / "new")]
    assert main([*train, "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"hybridpar: error: --resume {run}: is a run directory, not a checkpoint; use --resume (latest) "
                   f"with --train.run_dir {run}, or --resume {ckpt}")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    assert main([*train, "--resume", str(hf)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"hybridpar: error: --resume {hf}: is a Hugging Face model directory, not a checkpoint; "
                   f"use --train.init_from {hf}")
    assert main(["generate", "--checkpoint", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"hybridpar: error: checkpoint {run} is a run directory, not a checkpoint; pass one of its "
                   f"checkpoints, e.g. {ckpt}")
    assert main([*train, "--train.init_from", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"'{ckpt}' is a hybridpar checkpoint, not a Hugging Face model directory" in err[0]
    assert f"--resume {ckpt}" in err[0] and "hybridpar convert" in err[0]
    assert not (tmp_path / "new").exists()


# ----------------------------------------------------------------------------- modes


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_checkpoint_modes_follow_the_umask(tiny, tmp_path, umask):
    old = os.umask(umask)
    try:
        ckpt = tiny.save(tmp_path / "r", 1, tokenizer=ByteTokenizer())
    finally:
        os.umask(old)
    assert stat.S_IMODE(ckpt.stat().st_mode) == 0o777 & ~umask
    files = list(ckpt.iterdir())
    assert {f.name for f in files} >= {"complete.json", "config.json", ".metadata", "__0_0.distcp",
                                       "tokenizer-info.json"}
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f
