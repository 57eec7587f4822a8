"""ZeRO-3's FP8 parameter all-gather (``fp8.all_gather``) trains the model the FP8 run
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
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.parallel.fp8 import Fp8Layout, to_fp8
from hybridpar.parallel.zero import shard_model
from hybridpar.training.trainer import Trainer

pytestmark = pytest.mark.numerics

FP8 = ("--fp8.recipe", "tensorwise")
AG = ("--fp8.all_gather", "true")
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


def _linear_pair() -> tuple[torch.nn.Module, torch.Tensor]:
    """Two FP8 linears whose weights' row blocks differ in amax by powers of two (so a scale from
    one rank's rows alone would differ from the whole weight's), and an input."""
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48, bias=False), torch.nn.Linear(48, 16, bias=False))
    with torch.no_grad():
        for layer, factor in zip(model, (1.0, 8.0), strict=True):
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen))
            layer.weight[layer.weight.shape[0] // 2:] *= factor * 37.0  # the second rank's rows
            to_fp8(layer, Fp8Layout("tensorwise"))
    return model, torch.randn(16, 32, generator=gen)


def _gathered_linears(rank: int, world: int) -> tuple[list[float], list[float], int]:
    """Output and input gradient of the pair, its weights ZeRO-3-sharded over dp with FP8 gathers,
    and the bytes this rank's gathers sent."""
    model, x = _linear_pair()
    with ParallelDims(dp=world).build("cpu") as topo:
        sharded = shard_model(model, topo.dp, list(model), fp8_gather=True)
        x.requires_grad_(True)
        y = model(x)
        y.square().sum().backward()
        sharded.finish()
        sent = topo.comm.counter.bytes(op=Op.ALL_GATHER, axis=topo.dp.name)
        return y.detach().flatten().tolist(), x.grad.flatten().tolist(), sent


def test_gathered_fp8_weights_quantize_as_the_whole_weight(dist_run: Any) -> None:
    """Each weight's scale comes from the whole weight, not this rank's rows (whose amax differs
    by powers of two here): output and input gradient equal the unsharded FP8 linears' exactly."""
    model, x = _linear_pair()
    x.requires_grad_(True)
    y = model(x)
    y.square().sum().backward()
    for got_y, got_dx, sent in dist_run(2, _gathered_linears):
        assert got_y == y.detach().flatten().tolist()
        assert got_dx == x.grad.flatten().tolist()
        assert sent == 2 * (24 * 32 + 8 * 48)  # each unit gathered twice (forward, backward), 1 byte per element


@pytest.mark.parametrize("flags, message", [
    ([*AG, *FP8], "fp8.all_gather = true needs parallel.zero_stage = 3 (got 0)"),
    ([*AG, "--parallel.dp", "2", "--parallel.zero_stage", "3"],
     "fp8.all_gather = true needs fp8.recipe = 'tensorwise' (got 'none')"),
    ([*AG, "--parallel.dp", "2", "--parallel.zero_stage", "3", "--fp8.recipe", "rowwise"],
     "fp8.all_gather = true needs fp8.recipe = 'tensorwise' (got 'rowwise')"),
])
def test_fp8_all_gather_refused_before_launch(flags: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [*MODEL, *flags])
    assert message in str(info.value) and "\n" not in str(info.value)
