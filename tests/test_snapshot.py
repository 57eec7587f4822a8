"""In-memory snapshots (``train.snapshot_every``): the store's files, the bad cases, and recovery.

* A shard is whole only with its record (written last); a torn or corrupt one is found by its
  checksum and skipped; a copy that fails leaves the previous snapshot as it was.
* Snapshots that need more host memory than the budget are refused at launch, with the numbers.
* Two ranks as two nodes (``LOCAL_WORLD_SIZE=1``) on the test's worker pool: each rank's store in a
  folder of its own, every shard replicated to the other. After 4 steps the run continues from the
  snapshot of step 4 and ends bit for bit equal to the uninterrupted 6-step run (losses, weights,
  optimizer state); with one node's store lost it continues from the peer's replicas, equally; with
  the newest shard of one rank corrupt it continues from the snapshot before; with no snapshot it
  falls back to the disk checkpoint and says so.
* Through the library's launcher (``--max-restarts 1``, nothing else): a rank SIGKILLed after step 4
  costs one step (the job continues from the snapshot of step 3 without reading the disk) and ends
  bit for bit equal to the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
from layouts import trainer_for
from test_cli import BASE, losses
from test_faults import FAULT_ENV, FAULTS, _run

from hybridpar.cli import main
from hybridpar.config import load_config
from hybridpar.distributed.launch import SNAPSHOT_STORE_ENV
from hybridpar.training.checkpoint import load_model_state, snapshot, step_dir
from hybridpar.training.checkpoint.snapshot import (
    held,
    shard_file,
    shard_problem,
    step_path,
    write_shard,
)

ARGS = [*BASE, "--train.steps", "6", "--parallel.dp", "2"]


# ----------------------------------------------------------------------------- the store's files


def _state(value: float) -> dict:
    return {"model": {"w": torch.full((4, 3), value)}, "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.95)}]},
            "extra": {"scaler": {"scale": torch.tensor(1.0, dtype=torch.float64)}}}


def test_a_shard_is_whole_only_with_its_record_and_a_corrupt_one_is_found_by_its_checksum(tmp_path):
    meta = {"world": 2, "layout": "dp2"}
    shard = write_shard(tmp_path, 3, 1, _state(1.5), meta)
    assert shard == shard_file(step_path(tmp_path, 3), 1)
    assert shard_problem(shard, 2, "dp2") is None
    loaded = snapshot.read_shard(shard, 2, "dp2")
    assert torch.equal(loaded["state"]["model"]["w"], torch.full((4, 3), 1.5))
    assert loaded["state"]["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert "taken by 2 ranks under layout 'dp2', this job is 4 ranks" in shard_problem(shard, 4, "dp2")
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size, one byte flipped
    shard.write_bytes(bytes(data))
    assert shard_problem(shard, 2, "dp2") == f"{shard} is corrupt ({len(data)} bytes, its sha256 differs from its record)"
    with pytest.raises(snapshot.CheckpointError, match="is corrupt"):
        snapshot.read_shard(shard, 2, "dp2")
    snapshot.record_file(shard).unlink()  # torn: the bytes without their record
    assert shard_problem(shard, 2, "dp2") == f"{shard} is incomplete (no record: its copy was interrupted)"


def test_a_copy_that_fails_leaves_the_previous_snapshot_whole(tmp_path, monkeypatch):
    meta = {"world": 1, "layout": "dp1"}
    write_shard(tmp_path, 1, 0, _state(1.0), meta)
    real_save = torch.save

    def torn_save(obj, path):  # half the bytes reach the store, then the copy dies
        real_save(obj, path)
        Path(path).write_bytes(Path(path).read_bytes()[:100])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="No space left"):
        write_shard(tmp_path, 2, 0, _state(2.0), meta)
    assert [(s, o) for s, o, _ in held(tmp_path)] == [(1, 0)]  # step 2 has no shard with a record
    assert shard_problem(shard_file(step_path(tmp_path, 1), 0), 1, "dp1") is None
    snapshot.prune(tmp_path, 0, keep_from=1)  # pruning keeps the whole one
    assert [(s, o) for s, o, _ in held(tmp_path)] == [(1, 0)]


def test_snapshots_that_do_not_fit_the_memory_budget_are_refused_at_launch(tmp_path, capsys):
    code = main(["train", *ARGS, "--nproc", "2", "--max-restarts", "1", "--train.run_dir", str(tmp_path / "r"),
                 "--train.snapshot_memory_fraction", "1e-9"])
    err = capsys.readouterr().err
    assert code == 2, err
    line = next(ln for ln in err.splitlines() if "in-memory snapshots need about" in ln)
    assert "per node (2 ranks x" in line and "x 3 copies)" in line and "train.snapshot_memory_fraction = 1e-09" in line
    assert "set train.snapshot_every = 0 (disk checkpoints only)" in line
    assert not (tmp_path / "r" / "metrics.jsonl").exists()  # refused before any worker started


# ----------------------------------------------------------------------------- recovery, in-process


def _uninterrupted(rank: int, world: int, run_dir: str) -> None:
    with trainer_for(load_config(None, [*ARGS, "--train.run_dir", run_dir])) as trainer:
        trainer.fit()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The uninterrupted 6-step dp2 run every recovery must end bit for bit equal to: one run
    directory, trained once for the module (each test only reads it)."""
    from harness import run_distributed

    ref = tmp_path_factory.mktemp("snapshot") / "ref"
    run_distributed(2, _uninterrupted, str(ref))
    return ref


class _Crash(Exception):
    """The simulated failure: a rank dies once a step returns, before anything after it runs."""


def _crash_after(trainer, step: int) -> None:
    real = trainer.train_step

    def train_step(s: int):
        result = real(s)
        if s == step:
            raise _Crash(s)
        return result

    trainer.train_step = train_step


def _snapshot_then_recover(rank: int, world: int, root: str, case: str) -> tuple[str, str, str]:
    """Two 'nodes' of one rank: train to step 5 taking snapshots (a disk checkpoint at step 3) and
    fail right after step 5 returns; damage the stores as ``case`` says and continue to step
    6 from what the ranks agree on. Returns the choice, the shards held and rank 0's words."""
    from hybridpar.training.elastic import agreed_latest_checkpoint, layout_name

    store = Path(root) / f"node-{rank}"
    store.mkdir(parents=True, exist_ok=True)
    os.environ.update({SNAPSHOT_STORE_ENV: str(store), "LOCAL_WORLD_SIZE": "1"})
    run_dir = Path(root) / "run"
    cfg = load_config(None, [*ARGS, "--train.checkpoint_every", "3", "--train.run_dir", str(run_dir)])
    from hybridpar.training.features import snapshot as component

    real_write = component.write_shard

    def write_shard(store, step, owner, state, meta):  # "copy fails": rank 1's copy of step 4 fails
        if case == "copy fails" and (step, owner) == (4, 1):
            raise OSError(28, "No space left on device")
        return real_write(store, step, owner, state, meta)

    component.write_shard = write_shard
    words = io.StringIO()
    try:
        with trainer_for(cfg) as trainer:
            _crash_after(trainer, 5)
            with contextlib.suppress(_Crash), contextlib.redirect_stderr(words):
                trainer.fit()
            held_after = sorted((s, o) for s, o, _ in held(store))
            trainer.topo.comm.barrier(trainer.topo.world)
            if case in ("node lost", "none") and (rank == 1 or case == "none"):
                shutil.rmtree(store)
                store.mkdir()
            if case == "corrupt":  # rank 1's shard of step 4, its own and the replica on the other node
                shard = shard_file(step_path(store, 4), 1)
                shard.write_bytes(b"x" * shard.stat().st_size)
            trainer.topo.comm.barrier(trainer.topo.world)
        with trainer_for(cfg) as trainer:
            with contextlib.redirect_stdout(words), contextlib.redirect_stderr(words):
                chosen = agreed_latest_checkpoint(trainer.topo, run_dir, None, restart=1,
                                                  layout=layout_name(cfg.parallel))
            trainer.fit(chosen)
        return str(chosen), json.dumps(held_after), words.getvalue()
    finally:
        component.write_shard = real_write
        for key in (SNAPSHOT_STORE_ENV, "LOCAL_WORLD_SIZE"):
            os.environ.pop(key, None)


def _same_final_state(run: Path, ref: Path) -> None:
    """Weights and every optimizer tensor of the final checkpoints, bit for bit."""
    from test_faults import _full_checkpoint

    _, want = load_model_state(step_dir(ref, 6))
    _, got = load_model_state(step_dir(run, 6))
    assert want.keys() == got.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    full_ref, full_run = _full_checkpoint(step_dir(ref, 6), run.parent), _full_checkpoint(step_dir(run, 6), run)
    assert any(k.startswith("optim/state/") and k.endswith("/exp_avg") for k in full_ref)
    for key, value in full_ref.items():
        if not key.startswith("rng/"):  # one rank's global RNG (ranks differ; training draws none from it)
            same = torch.equal(full_run[key], value) if isinstance(value, torch.Tensor) else full_run[key] == value
            assert same, key


@pytest.mark.parametrize("case", ["intact", "node lost", "corrupt", "copy fails", "none"])
def test_recovery_continues_from_the_newest_whole_snapshot_bit_for_bit(tmp_path, dist_run, uninterrupted, case):
    ref = uninterrupted
    (chosen, kept, words), (_, _, words1) = dist_run(2, _snapshot_then_recover, str(tmp_path / "job"), case)
    # each store held its own and the other node's shards of the last two steps (rank 1's of step
    # 4 nowhere when its copy failed)
    assert json.loads(kept) == [[3, 0], [3, 1], [4, 0]] + ([] if case == "copy fails" else [[4, 1]])
    run, store = tmp_path / "job" / "run", tmp_path / "job" / "node-0"
    said = "hybridpar: restart 1 of the job (torchrun --max-restarts): "
    expect = {
        "intact": (step_path(store, 4), f"resuming from the in-memory snapshot of step 4 ({store}); "
                   "the disk checkpoint is not read"),
        "node lost": (step_path(store, 4), f"resuming from the in-memory snapshot of step 4 ({store}, 1 shard from "
                      "a peer node's replica); the disk checkpoint is not read"),
        "corrupt": (step_path(store, 3), f"resuming from the in-memory snapshot of step 3 ({store}); "
                    "the disk checkpoint is not read"),
        "copy fails": (step_path(store, 3), f"resuming from the in-memory snapshot of step 3 ({store}); "
                       "the disk checkpoint is not read"),
        "none": (step_dir(run, 3), "no complete in-memory snapshot in the node stores, falling back to the disk "
                 f"checkpoint: resuming from {step_dir(run, 3)}")}[case]
    assert Path(chosen) == expect[0]
    assert said + expect[1] in words.splitlines(), words
    if case == "corrupt":  # each rank says which shard it skipped, and why
        bad = shard_file(step_path(tmp_path / "job" / "node-1", 4), 1)
        assert f"hybridpar: skipping snapshot shard {bad} is corrupt (" in words1, words1
    if case == "copy fails":  # one line, and training went on
        assert ("hybridpar: warning: in-memory snapshot snapshot-step-00000004 was not taken (" in words
                and "the previous snapshot stays the one to restart from, training goes on" in words), words
    text = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in text] == [1, 2, 3, 4, 5, 6]
    assert losses(run) == losses(ref)
    _same_final_state(run, ref)


# ----------------------------------------------------------------------------- through the launcher


def test_a_rank_killed_under_max_restarts_costs_one_step_and_the_run_is_unchanged(tmp_path, uninterrupted):
    ref, run = uninterrupted, tmp_path / "killed"
    path = os.pathsep.join(p for p in (str(FAULTS), os.environ.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "hybridpar.cli", "train", *ARGS, "--nproc", "2", "--max-restarts", "1",
           "--train.run_dir", str(run)]
    text = _run(cmd, tmp_path / "killed.log", **{FAULT_ENV: "4:1", "PYTHONPATH": path})
    said = [line for line in text.splitlines() if "restart 1 of the job" in line]
    assert len(said) == 1 and "resuming from the in-memory snapshot of step 3 (" in said[0], text[-4000:]
    assert said[0].endswith("the disk checkpoint is not read")
    assert "resumed from " in text and "snapshot-step-00000003 at step 3" in text
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert losses(run) == losses(ref)
    _same_final_state(run, ref)
    assert not any(Path("/dev/shm").glob("hybridpar-snapshots-*")) or all(
        str(p) not in text for p in Path("/dev/shm").glob("hybridpar-snapshots-*"))  # the launcher removed its store


NODE_ARGS = [*BASE, "--train.steps", "6", "--parallel.dp", "2", "--parallel.tp", "2"]


def _uninterrupted_dp2_tp2(rank: int, world: int, run_dir: str) -> None:
    with trainer_for(load_config(None, [*NODE_ARGS, "--train.run_dir", run_dir])) as trainer:
        trainer.fit()


def test_a_lost_node_recovers_from_its_peers_replicas_with_one_step_lost(tmp_path, dist_run):
    """Two launchers as two nodes of 2 ranks (``--elastic 4:4``, dp2 x tp2). The second node (its
    launcher, its workers and its snapshot store) is lost after training 3 steps, and a fresh
    launcher joins in its place: the job continues from the snapshot of step 2, the lost node's two
    shards sent back from the replicas on the first node, and ends bit for bit equal to the
    uninterrupted run."""
    from test_elastic_launch import _faults_env
    from test_faults import _free_port, _launched, _wait

    def _listening(port: int) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    ref, run = tmp_path / "ref", tmp_path / "run"
    dist_run(4, _uninterrupted_dp2_tp2, str(ref))
    port = _free_port()
    node = [sys.executable, "-m", "hybridpar.cli", "train", *NODE_ARGS, "--train.run_dir", str(run), "--elastic",
            "4:4", "--nproc", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "snapshot-node-test",
            "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1", "--max-restarts", "2"]
    logs = [tmp_path / "a.log", tmp_path / "b.log", tmp_path / "b2.log"]
    with _launched([node], _faults_env(), logs[:1]) as first:
        while not _listening(port):  # the first node hosts the rendezvous store (the one never lost)
            assert first[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.05)
        with _launched([node], _faults_env(HYBRIDPAR_FAULT_KILL_NODE_AFTER_STEPS="3"), logs[1:2]) as lost:
            assert lost[0].wait(timeout=300) == -9, logs[1].read_text()[-3000:]  # the node died
        with _launched([node], _faults_env(), logs[2:]) as replacement:
            codes = _wait([*first, *replacement], 300)
    text = "".join(log.read_text() for log in logs)
    assert codes == [0, 0], text[-5000:]
    said = [line for line in text.splitlines() if "elastic: 4 processes, layout" in line and "in-memory" in line]
    assert said and "resuming from the in-memory snapshot of step 2 (" in said[-1], text[-5000:]
    assert "2 shards from a peer node's replica); the disk checkpoint is not read" in said[-1]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5, 6]
    assert losses(run) == losses(ref)
    _same_final_state(run, ref)


def test_the_launchers_store_is_removed_at_the_end_and_a_killed_launchers_by_the_next(tmp_path, monkeypatch):
    """A SIGKILLed launcher (a lost node) cannot remove its store; the next launcher on the node
    removes the stores whose launcher is gone, and leaves a live one's."""
    import subprocess

    from hybridpar.distributed import launch

    monkeypatch.setattr(launch, "SHM", tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale, live = tmp_path / f"hybridpar-snapshots-{gone.pid}-x", tmp_path / f"hybridpar-snapshots-{os.getpid()}-y"
    stale.mkdir()
    live.mkdir()
    with launch.snapshot_store(True) as store:
        assert store is not None and store.parent == tmp_path and store.is_dir()
        assert store.name.startswith(f"hybridpar-snapshots-{os.getpid()}-")
        assert not stale.exists() and live.exists()
    assert not store.exists()
    with launch.snapshot_store(False) as none:
        assert none is None
