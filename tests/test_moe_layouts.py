"""Mixture of experts under every parallel layout equals one process (issue 19).

Same comparison and tolerances as :mod:`test_layouts` (losses to 1e-5 relative, weights to 1% of
lr x steps), on a small MoE model with unbalanced routing (a real router: nothing forces balance),
the load-balancing loss and z-loss on, so their gradients are part of what must agree."""

from __future__ import annotations

import pytest
import torch
from layouts import LR, Run, assert_trains_like, make_config, reference, train_layout, trainer_for
from numerics import layout_weight_atol
from test_layouts import WEIGHT_ATOL

from hybridpar.training.features.moe import MixtureOfExperts

pytestmark = pytest.mark.numerics

MOE = ("--model.family", "mixtral", "--model.n_experts", "4", "--model.experts_per_token", "2", "--model.moe_ffn_hidden", "32",
       "--model.aux_loss_coef", "0.05", "--model.z_loss_coef", "0.01", "--model.n_layers", "4",
       "--model.n_kv_heads", "4")

LAYOUTS = {
    "ep2": ["--parallel.dp", "2", "--parallel.ep", "2"],
    "ep4": ["--parallel.dp", "4", "--parallel.ep", "4"],
    "dp4-ep2": ["--parallel.dp", "4", "--parallel.ep", "2"],
    "tp2": ["--parallel.tp", "2"],
    "tp2-sp": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    "ep2-tp2": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.tp", "2"],
    "ep2-tp2-sp": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.tp", "2",
                   "--parallel.sequence_parallel", "true"],
    "cp2": ["--parallel.cp", "2"],
    "ep2-cp2": ["--parallel.cp", "2", "--parallel.ep", "2"],
    "ep2-pp2": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.pp", "2"],
    "pp2-zb": ["--parallel.pp", "2", "--parallel.pipeline_schedule", "zb-h1"],
    "pp2-interleaved": ["--parallel.pp", "2", "--parallel.pipeline_schedule", "interleaved",
                        "--parallel.virtual_stages", "2"],
    "ep2-zero1": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.zero_stage", "1"],
    "ep2-zero2": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.zero_stage", "2"],
    "ep2-recompute-full": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.recompute", "full"],
    "dp2-zero3": ["--parallel.dp", "2", "--parallel.zero_stage", "3"],
    "ep2-zero3": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.zero_stage", "3"],
    "dp4-ep2-zero3": ["--parallel.dp", "4", "--parallel.ep", "2", "--parallel.zero_stage", "3"],
    "dp4-ep2-tp2-zero3": ["--parallel.dp", "4", "--parallel.ep", "2", "--parallel.tp", "2", "--parallel.zero_stage", "3"],
    # the demo layout (8 processes), then 5D: dp (ep carved from it) x cp x tp x pp, 16 processes
    "dp2-ep2-tp2-pp2": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.tp", "2", "--parallel.pp", "2"],
    "dp2-ep2-cp2-tp2-pp2": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.cp", "2", "--parallel.tp", "2",
                            "--parallel.pp", "2"],
    "ep2-tp2-sp-chunked-loss": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.tp", "2",
                                "--parallel.sequence_parallel", "true", "--train.loss_chunk_tokens", "24"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_single_process(name, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "moe_layouts")
    ref = reference(Run(tmp, MOE))
    results = train_layout(Run(tmp, (*MOE, *LAYOUTS[name])))
    for rank, r in enumerate(results):
        # the first step's expert load, over all ranks' tokens: every slot routed (dropless), and
        # the same routing as one process (up to a near-tie flipped by rounding: a token or two)
        moe, expected = r.moe[0], ref.moe[0]
        load = torch.tensor(moe["expert_load"])
        assert moe["dropped_tokens"] == 0
        assert load.sum(1).tolist() == [8 * 32 * 2] * load.shape[0]  # global batch x seq_len x k per layer
        assert (load - torch.tensor(expected["expert_load"])).abs().max() <= 2, f"rank {rank}"
        assert moe["aux_loss"] == pytest.approx(expected["aux_loss"], rel=1e-5)
    assert_trains_like(results, ref, atol=WEIGHT_ATOL, same_keys=True)


def test_training_moves_the_balancing_bias_by_the_step_load(tmp_path):
    """With ``model.bias_update_rate`` each optimizer step moves every router's bias by
    ``rate * sign(mean - load)`` of that step's load (the one metrics.jsonl reports)."""
    rate = 0.01
    cfg = make_config(str(tmp_path), *MOE, "--model.bias_update_rate", str(rate))
    with trainer_for(cfg) as trainer:
        result = trainer.train_step(1)
        for moe, load in zip(trainer.hooks.find(MixtureOfExperts).layers, result.moe["expert_load"], strict=True):
            load = torch.tensor(load, dtype=torch.float64)
            expected = rate * torch.sign(load.mean() - load).float()
            assert expected.abs().sum() > 0  # the routing is unbalanced: the bias must move
            torch.testing.assert_close(moe.router.expert_bias, expected, rtol=0, atol=0)


# ----------------------------------------------------------------------------- checkpoints across ep

SAVED_AT, TOTAL = 2, 4
RESHARD_ATOL = layout_weight_atol(LR, TOTAL)
SAVED = ("--parallel.dp", "2", "--parallel.ep", "2", "--parallel.tp", "2", "--parallel.zero_stage", "1")
CONTINUATIONS = {
    "ep4": ["--parallel.dp", "4", "--parallel.ep", "4"],
    "ep2-zero2": ["--parallel.dp", "4", "--parallel.ep", "2", "--parallel.zero_stage", "2"],
    "ep1-dp2": ["--parallel.dp", "2"],
    "one": [],
}


@pytest.fixture(scope="module")
def saved_moe_run(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("moe_reshard"))
    return tmp, train_layout(Run(tmp, (*MOE, *SAVED), TOTAL, save_at=SAVED_AT))[0]


@pytest.mark.parametrize("name", list(CONTINUATIONS))
def test_moe_checkpoint_reshards_across_ep(name, saved_moe_run):
    """Saved at dp2 x ep2 x tp2 (ZeRO-1), continued at ep4, ep2 under ZeRO-2, ep1 and one
    process: the same losses and weights as the uninterrupted run."""
    tmp, expected = saved_moe_run
    results = train_layout(Run(tmp, (*MOE, *CONTINUATIONS[name]), TOTAL, resume_from=SAVED_AT))
    for rank, r in enumerate(results):
        assert r.start == SAVED_AT, f"rank {rank}"
    assert_trains_like(results, expected, atol=RESHARD_ATOL)
