"""Elastic training: a job that loses (or regains) ranks re-plans its layout and continues the
same trajectory.

Each attempt of a job is what a launched rank does under ``hybridpar train --elastic``: plan the
layout for the world it got (``plan_for_world``), agree on the newest complete checkpoint, and
fit from there (``Trainer(..., elastic=change)``). A lost node is an attempt that stops after a
given step on every rank (the launcher then restarts the job with fewer processes: the next
attempt runs on the smaller worker pool). The runs share one module fixture, ordered so each
worker pool starts once:

* uninterrupted: dp2 x tp2 x pp2 on 8 processes, ``TOTAL`` steps, a checkpoint every 2;
* shrink at a checkpoint boundary: 8 processes to step 4 (its checkpoint complete), then 4;
* shrink then grow: 8 to step 2, 4 to step 4, 8 again to the end;
* shrink mid-interval: 8 to step 5 (past the step-4 checkpoint), then 4 redoes step 5.

Every continuation must equal the uninterrupted 8-process run and the one-process run with the
invariance matrix's tolerance (test_layouts.py: losses to 1e-5 relative, weights to an absolute
1% of lr x steps): same global batch, data order and learning-rate schedule, only the layout
and the micro-batching change. The two-launcher case (torchrun ``--nnodes 1:2`` with c10d, one
launcher killed) is ``test_elastic_launch.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from layouts import LR, make_config
from test_layouts import LAYOUTS, MODEL

from hybridpar import cli
from hybridpar.config import ConfigError, load_config
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.training import checkpoint
from hybridpar.training.elastic import WorldRange, agreed_latest_checkpoint, history, plan_for_world
from hybridpar.training.trainer import Trainer

pytestmark = pytest.mark.numerics  # layout equality: also run under other ATEN_CPU_CAPABILITY (Makefile)

TOTAL = 6
WEIGHT_ATOL = 0.01 * LR * TOTAL
JOB = [*LAYOUTS["dp2-tp2-pp2"], "--train.steps", str(TOTAL), "--train.checkpoint_every", "2",
       "--train.log_every", "1", "--train.eval_every", "0", "--train.sample_tokens", "4"]


class NodeLost(Exception):
    """Raised on every rank where the simulated node loss stops an attempt."""


class _Attempt(Trainer):
    """A Trainer whose job is lost once step ``lost_after`` has finished (logged and, when due,
    checkpointed): the next step never starts, on any rank."""

    lost_after: int | None = None

    def train_step(self, step: int):
        if self.lost_after is not None and step > self.lost_after:
            raise NodeLost(step)
        return super().train_step(step)


def attempt(rank: int, world: int, run_dir: str, lost_after: int | None) -> dict:
    """One attempt of the elastic job on ``world`` ranks (what ``hybridpar train --elastic`` runs
    on each rank); returns rank 0's full weights when it trained to the end."""
    cfg, change = plan_for_world(make_config(run_dir, *MODEL, *JOB), world)
    with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
        resume = agreed_latest_checkpoint(topo, Path(run_dir), None, change)
        trainer = _Attempt(cfg, topo, elastic=change)
        trainer.lost_after = lost_after
        try:
            trainer.fit(resume)
        except NodeLost:
            return {"layout": change.layout, "lost": True}
        state = trainer.engine.full_state_dict()
        return {"layout": change.layout, "lost": False, "state": state if rank == 0 else None}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# (run, [(world, lost_after), ...]): each run's attempts in order
RUNS = {
    "uninterrupted": [(8, None)],
    "shrink": [(8, 4), (4, None)],
    "shrink-grow": [(8, 2), (4, 4), (8, None)],
    "mid-interval": [(8, 5), (4, None)],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{run: (run dir, [per-attempt rank-0 results])}, plus the one-process reference."""
    from harness import run_distributed

    root = tmp_path_factory.mktemp("elastic")
    results: dict[str, list[dict]] = {name: [] for name in RUNS}
    # by rounds (every run's first attempt, then every second one, ...), each round's attempts by
    # world size: 8, 4, 8 pools
    for i in range(max(len(a) for a in RUNS.values())):
        todo = [(name, a[i]) for name, a in RUNS.items() if i < len(a)]
        for name, (world, lost_after) in sorted(todo, key=lambda t: -t[1][0]):
            results[name].append(run_distributed(world, attempt, str(root / name), lost_after)[0])
    one = attempt(0, 1, str(root / "one"), None)
    return {name: (root / name, results[name]) for name in RUNS} | {"one": (root / "one", [one])}


def _assert_same_trajectory(got: Path, want: Path, got_state: dict, want_state: dict) -> None:
    steps = [r["step"] for r in _metrics(got)]
    assert steps == list(range(1, TOTAL + 1))  # each step logged once, redone ones included
    assert [r["loss"] for r in _metrics(got)] == pytest.approx([r["loss"] for r in _metrics(want)], rel=1e-5)
    assert [r["lr"] for r in _metrics(got)] == [r["lr"] for r in _metrics(want)]  # the same schedule
    assert got_state.keys() == want_state.keys()
    for k, v in got_state.items():
        torch.testing.assert_close(v, want_state[k], rtol=0, atol=WEIGHT_ATOL, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("name", ["shrink", "shrink-grow", "mid-interval"])
def test_elastic_run_ends_on_the_uninterrupted_trajectory(runs, name):
    run_dir, attempts = runs[name]
    assert [a["lost"] for a in attempts] == [True] * (len(attempts) - 1) + [False]
    for reference in ("uninterrupted", "one"):
        ref_dir, ref = runs[reference]
        _assert_same_trajectory(run_dir, ref_dir, attempts[-1]["state"], ref[-1]["state"])


def test_lost_ranks_re_plan_keeping_the_axes_that_still_divide_the_world(runs):
    run_dir, attempts = runs["shrink"]
    assert [a["layout"] for a in attempts] == ["dp2 tp2 pp2 cp1 zero0", "dp1 tp2 pp2 cp1 zero0"]
    changes = history(run_dir)
    assert [(c["step"], c["world"], c["layout"]) for c in changes] == [
        (0, 8, "dp2 tp2 pp2 cp1 zero0"), (4, 4, "dp1 tp2 pp2 cp1 zero0")]
    assert changes[0]["reason"] == "the configured layout (dp=2 x tp=2 x pp=2 x cp=1)"
    assert "gave up dp=2, kept tp=2, pp=2" in changes[1]["reason"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["layout_changes"] == changes
    assert summary["layout"] == "dp1 tp2 pp2 cp1 zero0"
    assert [r["world"] for r in _metrics(run_dir)] == [8, 8, 8, 8, 4, 4]


def test_grown_world_re_plans_upwards_to_the_configured_layout(runs):
    run_dir, _ = runs["shrink-grow"]
    assert [(c["step"], c["world"], c["layout"]) for c in history(run_dir)] == [
        (0, 8, "dp2 tp2 pp2 cp1 zero0"), (2, 4, "dp1 tp2 pp2 cp1 zero0"), (4, 8, "dp2 tp2 pp2 cp1 zero0")]
    assert [r["world"] for r in _metrics(run_dir)] == [8, 8, 4, 4, 8, 8]
    assert json.loads((run_dir / "summary.json").read_text())["layout_changes"] == history(run_dir)


def test_shrink_mid_interval_redoes_the_steps_since_the_last_checkpoint(runs):
    run_dir, _ = runs["mid-interval"]
    # step 5 was trained at 8, lost with its node, and trained again at 4 from the step-4 checkpoint
    assert [(c["step"], c["world"]) for c in history(run_dir)] == [(0, 8), (4, 4)]
    assert [r["world"] for r in _metrics(run_dir)] == [8, 8, 8, 8, 4, 4]
    assert checkpoint.latest_checkpoint(run_dir) == checkpoint.step_dir(run_dir, TOTAL)


def test_uninterrupted_elastic_run_records_one_layout(runs):
    run_dir, _ = runs["uninterrupted"]
    assert [(c["step"], c["world"]) for c in history(run_dir)] == [(0, 8)]
    assert [r["world"] for r in _metrics(run_dir)] == [8] * TOTAL


def _plan_check(rank: int, world: int, run_dir: str) -> str:
    """Every rank plans for its world; rank 1's node (as if it saw another hardware model) plans
    another micro-batch. Returns what the agreement check said ("" when it passed)."""
    from hybridpar.training.elastic import check_same_plan

    cfg, _ = plan_for_world(make_config(run_dir, *MODEL, *JOB), world)
    if rank == 1:
        cfg.train.micro_batch *= 2
    try:
        check_same_plan(cfg, world, "cpu")
    except ConfigError as e:
        return str(e)
    return ""


def test_ranks_that_planned_different_layouts_are_refused_before_the_mesh(tmp_path, dist_run):
    said = dist_run(8, _plan_check, str(tmp_path))  # the 8-process pool of the runs above
    assert said[1].startswith("elastic: the 8 processes planned different layouts (this one: dp2 tp2 pp2")
    assert all("every node must plan alike: set train.hardware" in s for s in said), said
    assert _plan_check(0, 1, str(tmp_path)) == ""  # one process: nothing to agree on


# ----------------------------------------------------------------------------- planning, no processes


def test_world_range_parses_and_refuses_worlds_outside_it():
    assert WorldRange.parse("4:8") == WorldRange(4, 8)
    assert WorldRange.parse("8") == WorldRange(8, 8)
    for bad in ("8:4", "0:4", "a:b", "1:2:3"):
        with pytest.raises(ConfigError, match="must be MIN:MAX"):
            WorldRange.parse(bad)
    with pytest.raises(ConfigError, match="the job has 2 processes, outside --elastic 4:8"):
        WorldRange(4, 8).check(2)


def test_world_that_cannot_divide_the_batch_is_refused_naming_the_worlds_that_can(tmp_path):
    """global batch 4, 2 layers, 2 KV heads, 32 tokens: 3 processes fit no axis (dp 3 does not
    divide the batch, pp 3 > layers, tp 3 > KV heads, 2 * cp 6 does not divide 32)."""
    from test_cli import BASE

    cfg = load_config(None, [*BASE, "--parallel.dp", "2", "--train.run_dir", str(tmp_path)])
    with pytest.raises(ConfigError) as e:
        plan_for_world(cfg, 3)
    msg = str(e.value)
    assert msg.startswith("elastic: 3 processes cannot continue this job (no layout of 3 runs it:")
    assert "the smallest world that can run it is 1 process (the next above 3: 4 processes)" in msg


def test_world_too_small_for_the_model_is_refused_by_the_memory_model(tmp_path):
    """A 6.7B-parameter model trained on 4 A100-40GB ranks loses 2: its fp32 weights, gradients and Adam moments
    (16 bytes a parameter) cannot be split over 2 ranks of 40 GiB even fully sharded, so the
    planner's memory model refuses 2 processes before anything is loaded, and the world it
    names is one that the same bytes can be split over."""
    from hybridpar.planner.machine.hardware import GPUS

    big = ["--model.dim", "4096", "--model.n_layers", "32", "--model.n_heads", "32", "--model.n_kv_heads", "32",
           "--model.ffn_hidden", "11008", "--model.vocab_size", "32000", "--train.seq_len", "64",
           "--train.global_batch", "32", "--train.micro_batch", "1", "--train.hardware", "A100-40GB",
           "--train.run_dir", str(tmp_path)]
    cfg = load_config(None, [*big, "--parallel.tp", "4"])  # configured for 4, 2 left
    state, capacity = 16 * cfg.model.num_params(), GPUS["A100-40GB"].hbm_bytes
    assert state / 2 > capacity  # analytically: no layout of 2 ranks holds it
    with pytest.raises(ConfigError) as e:
        plan_for_world(cfg, 2)
    msg = str(e.value)
    assert msg.startswith("elastic: 2 processes cannot continue this job") and "does not fit in device memory" in msg
    smallest = int(msg.split("the smallest world that can run it is ")[1].split(" ")[0])
    assert state / smallest <= capacity  # a necessary condition for the named world
    planned, _ = plan_for_world(cfg, smallest)
    assert planned.parallel.world_size == smallest


@pytest.mark.parametrize("args, needle", [
    (["--elastic", "2:4", "--nproc", "3"], "elastic: 3 processes cannot continue this job"),
    (["--elastic", "2:4", "--nproc", "8"], "the job has 8 processes, outside --elastic 2:4"),
    (["--elastic", "4:2"], "--elastic '4:2' must be MIN:MAX"),
    (["--elastic", "2:4", "--nproc", "5", "--rdzv-endpoint", "127.0.0.1:1"], "holds no whole number of nodes"),
    (["--elastic", "2:4", "--nproc", "2", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-conf", "x"], "must be KEY=VALUE"),
    (["--rdzv-endpoint", "127.0.0.1:1"], "--rdzv-endpoint, --rdzv-id and --rdzv-conf need --elastic MIN:MAX"),
])
def test_elastic_launcher_refuses_before_launch(tmp_path, capsys, args, needle):
    """Every world the launcher's nodes can form is planned before anything starts (the tiny
    model of test_cli cannot run on 3 processes: see the refusal test above)."""
    from test_cli import TINY

    run = tmp_path / "r"
    assert cli.main(["train", *TINY, "--train.run_dir", str(run), *args]) == 2
    assert needle in capsys.readouterr().err
    assert not run.exists()


def test_elastic_worker_refuses_a_world_it_cannot_use_before_any_process_group(tmp_path, capsys, monkeypatch):
    from test_cli import TINY

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    run = tmp_path / "r"
    assert cli.main(["train", *TINY, "--parallel.dp", "2", "--train.run_dir", str(run), "--elastic", "1:4"]) == 2
    assert "elastic: 3 processes cannot continue this job" in capsys.readouterr().err
    assert not run.exists()


def test_workers_under_torchrun_warn_when_a_joining_node_would_hang():
    """torch's agents share their store with the workers unless told not to; then a node joining
    the running job waits for an address that is never published (see launch.SHARED_STORE_ENV)."""
    from hybridpar.distributed.lifecycle import ERROR_DIR_ENV
    from hybridpar.training.elastic import shared_store_warning

    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared_store_warning(shared)
    assert shared_store_warning({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # unshared
    assert shared_store_warning({**shared, "RANK": "1"}) is None  # rank 0 says it
    assert shared_store_warning({**shared, "TORCHELASTIC_RESTART_COUNT": "1"}) is None  # once
    assert shared_store_warning({**shared, ERROR_DIR_ENV: "/tmp/x"}) is None  # the library's launcher unshares
