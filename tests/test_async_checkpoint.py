"""``async_checkpoint.enabled``: checkpoints staged in host memory at the step boundary and written
by a background thread. The checkpoint is the synchronous one (same tensors, bit for bit, at a
multi-rank layout); resuming from it is bit for bit; a writer that fails or a process that dies
before ``complete.json`` leaves the previous checkpoint as the one ``--resume`` picks; a failure
is raised at the step boundary after it; a stop on a signal waits for the save in flight."""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from layouts import SMALL, make_trainer, trainer_for
from test_checkpoint import losses, make, weights
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hybridpar.cli import main
from hybridpar.config import load_config
from hybridpar.distributed.lifecycle import Preempted, StopRequest
from hybridpar.training import checkpoint
from hybridpar.training.checkpoint import CheckpointError, HostStager, SafeReader, manifest, writer
from hybridpar.training.trainer import Trainer

ASYNC = ("--async_checkpoint.enabled", "true")
SHORT = ("--train.steps", "6", "--train.checkpoint_every", "3")  # checkpoints at steps 3 and 6


def saved_tensors(path: Path) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every tensor of a checkpoint, whole (as one process reads it, whatever layout wrote it),
    by its key; and the keys of its other (non-tensor) entries."""
    entries = SafeReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in entries.items()
             if isinstance(m, TensorStorageMetadata)}
    with checkpoint.single_process_quiet():
        dcp.load(state, storage_reader=SafeReader(str(path)), no_dist=True)
    return state, set(entries) - set(state)


def leftovers(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".old-", ".del-")))


# ----------------------------------------------------------------------------- multi-rank


def _sync_async_resumed(rank: int, world: int, tmp: str, layout: tuple[str, ...]) -> list[str]:
    """Train 4 steps (checkpoints at 2 and 4) synchronously and asynchronously, then resume the
    asynchronous run's step 2 to step 4 asynchronously; returns the parameters of this rank
    whose resumed value differs from the uninterrupted asynchronous run's."""
    def run(name: str, *extra: str, resume: Path | None = None) -> dict[str, torch.Tensor]:
        cfg = load_config(None, [*SMALL, *layout, "--train.run_dir", f"{tmp}/{name}", "--train.steps", "4",
                                 "--train.checkpoint_every", "2", "--train.eval_every", "0", *extra])
        torch.manual_seed(0)  # the process's RNG (saved in checkpoints) starts alike in each run
        with trainer_for(cfg) as trainer:
            trainer.fit(resume)
            return weights(trainer)

    run("sync")
    whole = run("async", *ASYNC)
    resumed = run("resumed", *ASYNC, resume=checkpoint.step_dir(Path(tmp) / "async", 2))
    return [k for k, v in whole.items() if not torch.equal(resumed[k], v)]


@pytest.mark.numerics  # exact comparisons: run under every ATEN_CPU_CAPABILITY in CI
@pytest.mark.parametrize("layout", [("--parallel.dp", "2", "--parallel.zero_stage", "1"), ("--parallel.tp", "2")],
                         ids=["dp2-zero1", "tp2"])
def test_async_checkpoint_equals_the_sync_one_and_resumes_bit_for_bit(tmp_path, dist_run, layout):
    differ = dist_run(2, _sync_async_resumed, str(tmp_path), layout)
    assert differ == [[], []], differ  # resumed from the asynchronous step 2 == uninterrupted
    for step in (2, 4):
        sync, sync_other = saved_tensors(checkpoint.step_dir(tmp_path / "sync", step))
        done, done_other = saved_tensors(checkpoint.step_dir(tmp_path / "async", step))
        assert set(done) == set(sync) and done_other == sync_other
        assert any(k.startswith("optim.") for k in sync) and any(k.startswith("model.") for k in sync)
        for k, v in sync.items():
            assert torch.equal(done[k], v), (step, k)
    assert losses(tmp_path / "async") == losses(tmp_path / "sync")
    assert losses(tmp_path / "resumed") == {k: v for k, v in losses(tmp_path / "async").items() if k > 2}
    for run in ("sync", "async", "resumed"):
        assert leftovers(tmp_path / run) == []


# ----------------------------------------------------------------------------- one process


@pytest.mark.numerics  # exact comparisons: run under every ATEN_CPU_CAPABILITY in CI
def test_a_slow_background_copy_still_saves_the_state_of_its_step(tmp_path, monkeypatch):
    """The thread copies the live state while the next step's forward and backward run; that
    step's optimizer update waits for the copy (``hold``). With a copy slower than a step, the
    checkpoint still holds the state of its own step, tensor for tensor the synchronous one."""
    real = HostStager.stage

    def slow(self, state):
        time.sleep(1.0)  # the next step runs meanwhile, up to its optimizer update
        return real(self, state)

    monkeypatch.setattr(HostStager, "stage", slow)
    for name, extra in (("sync", ()), ("async", ASYNC)):
        torch.manual_seed(0)
        make(tmp_path, name, "--train.steps", "4", "--train.checkpoint_every", "2", *extra).fit()
    for step in (2, 4):
        sync, _ = saved_tensors(checkpoint.step_dir(tmp_path / "sync", step))
        done, _ = saved_tensors(checkpoint.step_dir(tmp_path / "async", step))
        assert set(done) == set(sync)
        for k, v in sync.items():
            assert torch.equal(done[k], v), (step, k)


@pytest.mark.numerics  # exact comparisons: run under every ATEN_CPU_CAPABILITY in CI
def test_resume_after_a_crash_from_an_async_checkpoint_is_bit_for_bit(tmp_path, monkeypatch):
    """A crash at step 5 (the save of step 3 may still be in flight: the failing loop gives it
    time to finish) resumes from step 3 to the uninterrupted run's weights and losses."""
    full = make(tmp_path, "full", *SHORT)
    full.fit()
    crashing = make(tmp_path, "crash", *SHORT, *ASYNC)
    real_step = Trainer.train_step

    def step_until_5(self, step):
        if step == 5:
            raise KeyboardInterrupt("simulated crash")
        return real_step(self, step)

    monkeypatch.setattr(Trainer, "train_step", step_until_5)
    with pytest.raises(KeyboardInterrupt):
        crashing.fit()
    monkeypatch.setattr(Trainer, "train_step", real_step)
    run = tmp_path / "crash"
    assert checkpoint.resolve_resume("latest", run).name == "step-000003"
    resumed = make(tmp_path, "crash", *SHORT, *ASYNC)
    resumed.fit(resume=checkpoint.resolve_resume("latest", run))
    ref = weights(full)
    for k, v in weights(resumed).items():
        assert torch.equal(v, ref[k]), k
    assert losses(run) == losses(tmp_path / "full")
    assert [s for s, _ in resumed.checkpoint_stalls] == [6]


def test_a_failed_background_write_is_raised_at_the_next_step_and_keeps_the_previous(tmp_path, monkeypatch):
    """The writer of step 3 fails before its complete.json: the error comes at the first step
    boundary after the writer ended (step 4 here: the test lets the writer finish first), as
    one CheckpointError; step 2 stays the checkpoint --resume picks; nothing is left behind."""
    real_publish = writer._publish

    def publish(tmp, path, step, world_size):
        if step == 3:
            raise OSError(errno.EIO, "Input/output error (simulated)")
        real_publish(tmp, path, step, world_size)

    monkeypatch.setattr(writer, "_publish", publish)
    trainer = make(tmp_path, "r", "--train.steps", "6", "--train.checkpoint_every", "1", *ASYNC)
    real_step = Trainer.train_step

    def step(self, n):
        if n == 4:
            self.writer._thread.join()  # the background write of step 3 has ended (and failed)
        return real_step(self, n)

    monkeypatch.setattr(Trainer, "train_step", step)
    with pytest.raises(CheckpointError) as e:
        trainer.fit()
    run = tmp_path / "r"
    msg = str(e.value)
    assert "\n" not in msg and f"checkpoint {checkpoint.step_dir(run, 3)} could not be written: " in msg, msg
    assert "Input/output error (simulated)" in msg and "the previous checkpoints are intact" in msg, msg
    assert max(losses(run)) == 4  # raised at step 4's boundary, before step 5
    assert checkpoint.resolve_resume("latest", run).name == "step-000002"
    assert leftovers(run) == []


KILLED = 77


@pytest.mark.numerics  # exact comparisons: run under every ATEN_CPU_CAPABILITY in CI
def test_a_process_killed_before_the_marker_leaves_the_previous_checkpoint(tmp_path):
    """A child trains with async checkpoints and dies (``os._exit``, like SIGKILL) in the writer
    thread just before step 6's complete.json: its shards are on disk in ``.tmp-step-000006``,
    step 3 is what --resume picks, and resuming from it gives the uninterrupted weights."""
    run = tmp_path / "killed"
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            torch.set_num_threads(1)
            real = manifest.write_durable

            def write(path, text):
                if path.name == checkpoint.COMPLETE and path.parent.name == ".tmp-step-000006":
                    os._exit(KILLED)
                real(path, text)

            manifest.write_durable = write
            make(tmp_path, "killed", *SHORT, *ASYNC).fit()
            code = 0
        finally:
            os._exit(code)
    deadline = time.monotonic() + 300
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the training child hung")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == KILLED
    partial = run / "checkpoints" / ".tmp-step-000006"
    assert (partial / ".metadata").is_file() and list(partial.glob("*.distcp"))  # died mid-save
    assert not checkpoint.is_complete(partial)
    assert checkpoint.latest_checkpoint(run).name == "step-000003"
    latest = checkpoint.resolve_resume("latest", run)
    assert latest.name == "step-000003"
    resumed = make(tmp_path, "killed", *SHORT)
    resumed.fit(resume=latest)
    full = make(tmp_path, "full", *SHORT)
    full.fit()
    ref = weights(full)
    for k, v in weights(resumed).items():
        assert torch.equal(v, ref[k]), k
    assert leftovers(run) == []  # the resumed run's next save removed the partial one


def test_a_stop_signal_waits_for_the_save_in_flight(tmp_path, monkeypatch):
    stop = StopRequest()
    cfg = load_config(None, [*SMALL, "--train.run_dir", str(tmp_path / "r"), "--train.steps", "10",
                             "--train.checkpoint_every", "2", "--train.eval_every", "0", *ASYNC])
    trainer = make_trainer(cfg, stop=stop)
    real_step = Trainer.train_step

    def step(self, n):
        if n == 3:
            stop.request(signal.SIGTERM)
        return real_step(self, n)

    monkeypatch.setattr(Trainer, "train_step", step)
    with pytest.raises(Preempted) as e:
        trainer.fit()
    run = tmp_path / "r"
    assert e.value.step == 3 and e.value.checkpoint == checkpoint.step_dir(run, 3)
    for s in (2, 3):  # both complete when Preempted is raised: the job may exit at once
        checkpoint.require_complete(checkpoint.step_dir(run, s))
    assert trainer.writer.in_flight is None and leftovers(run) == []


def test_cli_trains_with_async_checkpoints(tmp_path, capsys):
    run = tmp_path / "r"
    assert main(["train", *SMALL, "--train.run_dir", str(run), "--train.steps", "4", "--train.checkpoint_every", "1",
                 "--train.eval_every", "0", "--async_checkpoint.enabled", "true"]) == 0
    out = capsys.readouterr().out
    assert "checkpoints written in the background: training waited" in out and "(3 before the last)" in out, out
    assert [checkpoint.read_info(checkpoint.step_dir(run, s))["step"] for s in range(1, 5)] == [1, 2, 3, 4]
    assert leftovers(run) == []
