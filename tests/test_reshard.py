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
from layouts import LR, Run, assert_trains_like, train_layout
from numerics import layout_weight_atol
from test_layouts import LAYOUTS, MODEL

from hybridpar.training import checkpoint

pytestmark = pytest.mark.numerics  # layout equality: also run under other ATEN_CPU_CAPABILITY (Makefile)

SAVED_LAYOUT = LAYOUTS["dp2-tp2-pp2"]  # 1F1B, 8 processes
SAVED_AT = 2
TOTAL = 4
WEIGHT_ATOL = layout_weight_atol(LR, TOTAL)

CONTINUATIONS = {  # grouped by world size, so the worker pool is reused
    "dp4-zero3": ["--parallel.dp", "4", "--parallel.zero_stage", "3"],
    "tp4": LAYOUTS["tp4"],
    "pp4-interleaved": LAYOUTS["pp4-interleaved"],
    "pp4": LAYOUTS["pp4"],  # 1F1B: stages that share no parameter with either saved stage
    "cp2": LAYOUTS["cp2"],
    "one": [],
}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """(run dir holding the step-SAVED_AT checkpoint, rank 0's result of the uninterrupted run:
    TOTAL steps under the saved layout, saving the checkpoint after step SAVED_AT)."""
    tmp = str(tmp_path_factory.mktemp("reshard"))
    results = train_layout(Run(tmp, (*MODEL, *SAVED_LAYOUT), TOTAL, save_at=SAVED_AT))
    assert checkpoint.is_complete(checkpoint.step_dir(tmp, SAVED_AT))
    assert_trains_like(results, results[0], atol=None)  # every rank reports the same losses
    return tmp, results[0]


@pytest.mark.parametrize("name", list(CONTINUATIONS))
def test_checkpoint_from_3d_layout_continues_under(name, saved_run):
    """Load the checkpoint under the continuation's layout and train from its step to TOTAL."""
    tmp, expected = saved_run
    results = train_layout(Run(tmp, (*MODEL, *CONTINUATIONS[name]), TOTAL, resume_from=SAVED_AT), here_if_one=True)
    for rank, r in enumerate(results):
        assert r.start == SAVED_AT, f"rank {rank}"
    assert_trains_like(results, expected, atol=WEIGHT_ATOL, same_keys=True)
