"""DeepSeek-V3 under the parallel layouts equals one process (issue 43): the comparison and
tolerances of :mod:`test_moe_layouts` (losses to 1e-5 relative, weights to 1% of lr x steps) on a
tiny DeepSeek-V3: multi-head latent attention with a low-rank query, ``v_head_dim`` (12) unlike
the query/key head size (16 + 8 decoupled RoPE channels, interleaved), one dense layer then MoE
layers routed within groups (4 groups, 2 kept) with shared experts, ``routed_scaling_factor`` and
the sequence-wise balance loss (whose gradient is part of what must agree); the layouts named
``mtp`` with one multi-token prediction module (on the last stage under pp; tp with SP, cp ring
and Ulysses, ep with ZeRO, and the 5D layout)."""

from __future__ import annotations

import pytest
from layouts import Run, assert_trains_like, reference, train_layout
from test_fp8_layouts import assert_fp8_like_one_process
from test_layouts import WEIGHT_ATOL

pytestmark = pytest.mark.numerics

DS = ("--model.family", "deepseek_v3", "--model.n_layers", "3", "--model.n_kv_heads", "4",
      "--model.q_lora_rank", "24", "--model.kv_lora_rank", "32", "--model.qk_nope_head_dim", "16",
      "--model.qk_rope_head_dim", "8", "--model.v_head_dim", "12", "--model.rope_interleave", "true",
      "--model.n_experts", "8", "--model.experts_per_token", "2", "--model.moe_ffn_hidden", "32",
      "--model.moe_layers", "1,2", "--model.router_score", "sigmoid", "--model.n_group", "4",
      "--model.topk_group", "2", "--model.routed_scaling_factor", "2.5", "--model.n_shared_experts", "1",
      "--model.aux_loss_coef", "0", "--model.seq_aux_loss_coef", "0.01")
MTP = ("--model.mtp_layers", "1")

LAYOUTS = {
    "tp2-sp": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    "cp2-ring": ["--parallel.cp", "2"],
    "cp2-ulysses": ["--parallel.cp", "2", "--parallel.cp_mode", "ulysses"],
    "pp2-uneven": ["--parallel.pp", "2", "--parallel.stage_layers", "1,2"],
    "ep2-pp2-uneven": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.pp", "2", "--parallel.stage_layers", "1,2"],
    "ep2-mtp-zero1-compile": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.zero_stage", "1",
                              "--train.compile", "true", "--train.compile_backend", "aot_eager", *MTP],
    "ep2-mtp-zero3-recompute": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.zero_stage", "3",
                                "--parallel.recompute", "full", *MTP],
    "cp4-hybrid": ["--parallel.cp", "4", "--parallel.cp_mode", "hybrid", "--parallel.cp_ulysses", "2"],
    "ep2-tp2-sp-zero2": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.tp", "2",
                         "--parallel.sequence_parallel", "true", "--parallel.zero_stage", "2"],
    "pp2-uneven-mtp": ["--parallel.pp", "2", "--parallel.stage_layers", "1,2", *MTP],
    "tp2-sp-mtp": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true", *MTP],
    "cp2-ring-mtp": ["--parallel.cp", "2", *MTP],
    "cp2-ulysses-mtp": ["--parallel.cp", "2", "--parallel.cp_mode", "ulysses", *MTP],
    # 5D: dp (ep carved from it) x cp x tp x pp, the dense layer alone on the first stage, the
    # MTP module on the last beside the head
    "dp2-ep2-cp2-tp2-sp-pp2-mtp": ["--parallel.dp", "2", "--parallel.ep", "2", "--parallel.cp", "2",
                                   "--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--parallel.pp", "2",
                                   "--parallel.stage_layers", "1,2", *MTP],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_deepseek_layout_matches_single_process(name, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "deepseek_layouts")
    mtp = MTP if "mtp" in name else ()
    ref = reference(Run(tmp, (*DS, *mtp)))
    results = train_layout(Run(tmp, (*DS, *LAYOUTS[name])))
    assert_trains_like(results, ref, atol=WEIGHT_ATOL, same_keys=True)


def test_deepseek_fp8_ep2_trains_like_one_process_fp8(tmp_path_factory):
    """FP8 (tensorwise) under ep2 with group-limited routing: within :mod:`test_fp8_layouts`'
    bound of one FP8 process (twice the format's own error plus the layouts' tolerance)."""
    tmp = str(tmp_path_factory.getbasetemp() / "deepseek_layouts")
    fp8 = ("--train.fp8", "tensorwise")
    expected, plain = reference(Run(tmp, (*DS, *fp8))), reference(Run(tmp, DS))
    assert expected.losses[1:] != plain.losses[1:]  # FP8 changed the training (the MLA's and experts' matmuls)
    results = train_layout(Run(tmp, (*DS, *fp8, "--parallel.dp", "2", "--parallel.ep", "2")), timeout=600)
    assert_fp8_like_one_process(results, expected, plain)
