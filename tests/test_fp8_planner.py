"""``hybridpar plan --fp8``: the blocks' linear GEMMs at the data sheets' FP8 rate plus the
scaling passes (planner/price/fp8.py), checked against the roofline they are built from."""

from __future__ import annotations

import dataclasses

import pytest

from hybridpar.config import model_preset
from hybridpar.planner.machine.hardware import GPUS, Cluster, PlanError
from hybridpar.planner.model.layout import Layout, Workload, from_config, to_config
from hybridpar.planner.price.cost import gemm_time, layer_time, step_cost
from hybridpar.planner.price.fp8 import fp8_gemm_deltas


@pytest.mark.parametrize("gpu", ["H100-SXM", "H200", "B200"])
def test_data_sheet_fp8_rate_is_twice_bf16(gpu: str) -> None:
    assert GPUS[gpu].fp8_flops == pytest.approx(2 * GPUS[gpu].bf16_flops, rel=1e-3)


def test_a_large_gemm_takes_half_the_time_plus_the_scaling_passes() -> None:
    g = GPUS["H100-SXM"]
    m = n = k = 8192.0
    bf16 = lambda a, b, c: gemm_time(a, b, c, g, 2)  # noqa: E731
    df, di, dw = fp8_gemm_deltas([(m, n, k)], g, "tensorwise", bf16)
    t = bf16(m, n, k)
    saved = (t - g.launch_overhead) * (1 - g.bf16_flops / g.fp8_flops)  # the GEMM at the FP8 rate
    # compute bound at both rates: ~half the GEMM saved, 5 bytes per quantized element spent
    quant = lambda e: 5 * e / g.hbm_bw + 3 * g.launch_overhead  # noqa: E731
    assert df == pytest.approx(-saved + quant(m * k + n * k), rel=1e-6)
    assert di == pytest.approx(-saved + quant(m * n), rel=1e-6)
    assert dw == pytest.approx(-saved, rel=1e-6)  # tensorwise reuses x, W, dy
    _, _, dw_row = fp8_gemm_deltas([(m, n, k)], g, "rowwise", bf16)
    assert dw_row == pytest.approx(dw + quant(m * n + m * k), rel=1e-6)


def test_plan_prices_fp8_faster_on_h100_and_refuses_a100() -> None:
    model = model_preset("llama3-8b")
    layout = Layout(dp=8, zero_stage=3, micro_batch=1)
    times = {}
    for recipe in ("none", "tensorwise", "rowwise"):
        work = Workload(64, 4096, "bf16", fp8=recipe)
        times[recipe] = step_cost(model, layout, work, Cluster.of(GPUS["H100-SXM"], 8)).step_time_s
        lt = layer_time(model, layout, work, Cluster.of(GPUS["H100-SXM"], 8))
        assert lt.f > 0 and lt.w > 0
    assert times["tensorwise"] < times["rowwise"] < times["none"]
    with pytest.raises(PlanError, match="A100-80GB has no FP8 tensor cores"):
        step_cost(model, layout, Workload(64, 4096, "bf16", fp8="rowwise"), Cluster.of(GPUS["A100-80GB"], 8))


def test_fp8_travels_between_plan_and_config() -> None:
    work = Workload(16, 128, "bf16", fp8="rowwise")
    cfg = to_config(model_preset("tiny"), Layout(), work)
    assert cfg.fp8.recipe == "rowwise" and from_config(cfg)[1].fp8 == "rowwise"
    assert dataclasses.replace(work, fp8="none").fp8 == "none"


def test_fp8_all_gather_gathers_the_fp8_weights_at_one_byte(capsys) -> None:
    """``parallel.fp8_all_gather``: ZeRO-3's gathers carry the FP8 linears' weights at 1 byte per
    element instead of the parameter dtype's (plus 4 bytes of amax per weight and gather); the
    runtime's counted bytes equal these (test_planner_validation's dp2-zero3-fp8-all-gather)."""
    from hybridpar.cli import main
    from hybridpar.planner.model.shapes import shard_elems
    from hybridpar.planner.price.fp8 import is_fp8_weight
    from hybridpar.planner.price.traffic import comm_bytes_per_axis, model_params

    model, layout = model_preset("tiny"), Layout(dp=4, zero_stage=3, micro_batch=2)
    work = Workload(16, 128, "bf16", half_params=True, fp8="tensorwise")
    plain = comm_bytes_per_axis(model, layout, work)["dp"]
    gathered = comm_bytes_per_axis(model, layout, dataclasses.replace(work, fp8_all_gather=True))["dp"]
    weights = [s for n, s in model_params(model, 1) if is_fp8_weight(n)]
    assert len(weights) == 7 * model.n_layers
    m = layout.microbatches(16)  # two gathers per micro-batch: forward, backward
    assert plain - gathered == 2 * m * (shard_elems(weights, 4) * (2 - 1) - 4 * len(weights))
    # timed: the smaller gathers where they are exposed (8B, short sequences, 16 ranks)
    big, wide, short = model_preset("llama3-8b"), Layout(dp=16, zero_stage=3, micro_batch=1), Workload(16, 1024, fp8="tensorwise")
    cluster = Cluster.of(GPUS["H100-SXM"], 16, 8)
    before, after = (step_cost(big, wide, dataclasses.replace(short, fp8_all_gather=ag), cluster) for ag in (False, True))
    assert after.terms["dp_comm"] < before.terms["dp_comm"] and after.step_time_s < before.step_time_s
    cfg = to_config(model, layout, dataclasses.replace(work, fp8_all_gather=True))
    assert cfg.fp8.all_gather and from_config(cfg)[1].fp8_all_gather
    assert not to_config(model, Layout(dp=4, zero_stage=2), dataclasses.replace(work, fp8_all_gather=True)
                         ).fp8.all_gather
    assert main(["plan", "--model", "tiny", "--gpus", "4", "--global-batch", "16", "--seq-len", "128", "--json",
                 "--fp8", "tensorwise", "--fp8-all-gather", "--layout", "dp=4,tp=1,pp=1,cp=1,zero_stage=3"]) == 0
    import json
    assert json.loads(capsys.readouterr().out)["fp8_all_gather"] is True
