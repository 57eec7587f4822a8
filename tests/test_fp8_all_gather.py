"""ZeRO-3's FP8 parameter all-gather (``parallel.fp8_all_gather``) trains the model the FP8 run
without it trains, bit for bit, and so the model one process trains with FP8.

**Exact, not a tolerance.** Tensorwise scaling gives each weight one scale from ``max |W|``; the
FP8 gather computes it from each rank's rows, max-reduced over the ZeRO axis (and tp), which is
exactly the whole weight's amax (max is exact and order-free), so the scale is the same power of
two, and quantizing is elementwise, so the gathered e4m3 weight is element for element the one
the linear quantizes from the gathered fp32 weight without the option. Everything else (the
activations' and gradients' quantization, the GEMMs, the reductions) is unchanged, so losses and
weights must be equal exactly. Against one process the FP8 ZeRO-3 run is held to
``test_fp8_layouts``' bound (its module doc). The counted bytes equal the planner's: the
``dp2-zero3-fp8-all-gather`` case of ``test_planner_validation``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from layouts import Run, reference, train_layout
from test_fp8_layouts import MODEL, assert_fp8_like_one_process

from hybridpar.config import ConfigError, load_config
from hybridpar.distributed.comm import Op
from hybridpar.training.trainer import Trainer

pytestmark = pytest.mark.numerics

FP8 = ("--train.fp8", "tensorwise")
AG = ("--parallel.fp8_all_gather", "true")
LAYOUTS = {
    "dp2-zero3": ["--parallel.dp", "2", "--parallel.zero_stage", "3"],  # units per block, gathered twice
    "dp2-tp2-zero3": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.zero_stage", "3"],  # amax over tp too
    "dp2-pp2-zero3": ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.zero_stage", "3"],  # per stage, once
}


def reset_counter(trainer: Trainer) -> dict[str, Any]:
    """Before probe: count this run's traffic only."""
    trainer.topo.comm.counter.reset()
    return {}


def gathered_bytes(trainer: Trainer) -> dict[str, Any]:
    """After probe: the all-gather payload bytes over the ZeRO axis (the parameter gathers)."""
    return {"gathered": trainer.topo.comm.counter.bytes(op=Op.ALL_GATHER, axis=trainer.topo.zero.name)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp8_all_gather_equals_the_fp8_run_exactly(tmp_path: Any, name: str) -> None:
    tmp, probes = str(tmp_path), dict(before=reset_counter, after=gathered_bytes)
    without = train_layout(Run(tmp, (*MODEL, *FP8, *LAYOUTS[name]), **probes), timeout=600)
    with_ag = train_layout(Run(tmp, (*MODEL, *FP8, *AG, *LAYOUTS[name]), **probes), timeout=600)
    for rank, (a, b) in enumerate(zip(with_ag, without, strict=True)):
        assert a.losses == b.losses, f"rank {rank}"
        assert 0 < a.extra["gathered"] < b.extra["gathered"], f"rank {rank}: the gathers carried FP8"
    for k, w in with_ag[0].state.items():
        assert torch.equal(w, without[0].state[k]), k
    expected = reference(Run(tmp, (*MODEL, *FP8)))
    plain = reference(Run(tmp, MODEL))
    assert_fp8_like_one_process(with_ag, expected, plain)


@pytest.mark.parametrize("flags, message", [
    ([*AG, *FP8], "parallel.fp8_all_gather = true needs parallel.zero_stage = 3 (got 0)"),
    ([*AG, "--parallel.dp", "2", "--parallel.zero_stage", "3"],
     "parallel.fp8_all_gather = true needs train.fp8 = 'tensorwise' (got 'none')"),
    ([*AG, "--parallel.dp", "2", "--parallel.zero_stage", "3", "--train.fp8", "rowwise"],
     "parallel.fp8_all_gather = true needs train.fp8 = 'tensorwise' (got 'rowwise')"),
])
def test_fp8_all_gather_refused_before_launch(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [*MODEL, *flags])
    assert message in str(info.value) and "\n" not in str(info.value)
