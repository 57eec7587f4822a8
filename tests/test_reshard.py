"""Resharding checkpoints: saved under dp2 x tp2 x pp2, resumed under another layout (other dp,
tp, pp, cp, ZeRO stage, schedule and world size), training continues as if nothing changed.

One 8-process run trains ``TOTAL`` steps without interruption and saves a checkpoint after step
``SAVED_AT`` on the way (model, optimizer state, RNG and trainer state). Each continuation loads
that checkpoint under its own layout, takes its position (the sampler's global sample ids) from
the checkpoint's step, trains the remaining steps, and must equal the uninterrupted run: per-step
losses and final gathered weights, with the tolerance of the invariance matrix (test_layouts.py:
losses to 1e-5 relative, weights to an absolute 1% of lr x steps). Adam's moments matter here: a
continuation that restarted them would move every weight by about lr on its first step.
"""

from __future__ import annotations

import pytest
import torch
from test_layouts import LAYOUTS, LR, config

from hybridpar.distributed.mesh import ParallelDims
from hybridpar.training import checkpoint
from hybridpar.training.trainer import Trainer

pytestmark = pytest.mark.numerics  # layout equality: also run under other ATEN_CPU_CAPABILITY (Makefile)

SAVED_LAYOUT = LAYOUTS["dp2-tp2-pp2"]  # 1F1B, 8 processes
SAVED_AT = 2
TOTAL = 4
WEIGHT_ATOL = 0.01 * LR * TOTAL

CONTINUATIONS = {  # grouped by world size, so the worker pool is reused
    "dp4-zero3": ["--parallel.dp", "4", "--parallel.zero_stage", "3"],
    "tp4": LAYOUTS["tp4"],
    "pp4-interleaved": LAYOUTS["pp4-interleaved"],
    "pp4": LAYOUTS["pp4"],  # 1F1B: stages that share no parameter with either saved stage
    "cp2": LAYOUTS["cp2"],
    "one": [],
}


def _uninterrupted(rank: int, world: int, tmp: str) -> dict:
    """Train TOTAL steps under the saved layout, saving the checkpoint after step SAVED_AT."""
    cfg = config(tmp, SAVED_LAYOUT)
    with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
        trainer = Trainer(cfg, topo)
        losses = []
        for step in range(1, TOTAL + 1):
            losses.append(trainer.train_step(step).loss)
            if step == SAVED_AT:
                trainer.save_checkpoint(step)
        state = trainer.engine.full_state_dict()
        return {"losses": losses, "state": state if rank == 0 else None}


def _continue(rank: int, world: int, tmp: str, layout: list[str]) -> dict:
    """Load the checkpoint under ``layout`` and train from its step to TOTAL."""
    cfg = config(tmp, layout)
    with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
        trainer = Trainer(cfg, topo)
        start = trainer.load_checkpoint(checkpoint.step_dir(trainer.run_dir, SAVED_AT))
        losses = [trainer.train_step(step).loss for step in range(start + 1, TOTAL + 1)]
        state = trainer.engine.full_state_dict()
        return {"start": start, "losses": losses, "state": state if rank == 0 else None}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """(run dir holding the step-SAVED_AT checkpoint, rank 0's result of the uninterrupted run)."""
    from harness import run_distributed

    tmp = str(tmp_path_factory.mktemp("reshard"))
    results = run_distributed(config(tmp, SAVED_LAYOUT).parallel.world_size, _uninterrupted, tmp)
    assert checkpoint.is_complete(checkpoint.step_dir(tmp, SAVED_AT))
    for rank, r in enumerate(results):
        assert r["losses"] == pytest.approx(results[0]["losses"], rel=1e-5), f"rank {rank}"
    return tmp, results[0]


@pytest.mark.parametrize("name", list(CONTINUATIONS))
def test_checkpoint_from_3d_layout_continues_under(name, saved_run, dist_run):
    tmp, expected = saved_run
    layout = CONTINUATIONS[name]
    world = config(tmp, layout).parallel.world_size
    results = [_continue(0, 1, tmp, layout)] if world == 1 else dist_run(world, _continue, tmp, layout)
    for rank, r in enumerate(results):
        assert r["start"] == SAVED_AT, f"rank {rank}"
        assert r["losses"] == pytest.approx(expected["losses"][SAVED_AT:], rel=1e-5), f"rank {rank}"
    state = results[0]["state"]
    assert state.keys() == expected["state"].keys()
    for k, v in state.items():
        torch.testing.assert_close(v, expected["state"][k], rtol=0, atol=WEIGHT_ATOL, msg=lambda m, k=k: f"{k}: {m}")
