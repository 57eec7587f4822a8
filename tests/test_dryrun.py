"""``hybridpar train --dry-run`` (:mod:`hybridpar.training.dryrun`): a rank's real training step on
fake tensors and torch's fake process group, measured beside the planner.

Small worlds, a few ranks, two steps each, in this process (the fake process group needs no
workers): the traffic per axis equals :func:`hybridpar.planner.price.traffic.comm_bytes_per_axis` to the
byte and the FLOPs :func:`~hybridpar.training.dryrun.predicted_flops` exactly, on the ranks that
differ (first, last pipeline stage, the uneven ZeRO remainder). The measured traffic is the same
counter the gloo tests check against the planner (tests/test_planner_validation.py).
"""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from layouts import make_config
from test_deepseek_v3_layouts import DS, MTP

from hybridpar.config import ConfigError
from hybridpar.training.dryrun import default_ranks, dry_run
from hybridpar.training.dryrun_cli import cmd_dry_run

# FP8 GEMMs need every split dimension a multiple of 16
FP8_SHAPE = ["--model.dim", "64", "--model.ffn_hidden", "128", "--model.vocab_size", "2048", "--train.seq_len", "64",
             "--model.max_seq_len", "64", "--train.precision", "bf16", "--train.loss_chunk_tokens", "64"]
LAYOUTS = {
    "dp2-tp2-pp2": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2", "--model.n_layers", "4"],
    "cp2-zero3": ["--parallel.cp", "2", "--parallel.dp", "2", "--parallel.zero_stage", "3"],
    "tp2-sp-full": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--parallel.recompute", "full"],
    "moe-ep2-chunked-loss": ["--model.family", "mixtral", "--model.n_experts", "4", "--model.experts_per_token", "2",
                             "--model.moe_ffn_hidden", "32", "--parallel.dp", "2", "--parallel.ep", "2",
                             "--train.loss_chunk_tokens", "16"],
    # FP8's amax all-reduces over tp and cp, rerun with the forward (the down projection's GEMM too)
    "tp2-cp2-fp8-tensorwise-full": [*FP8_SHAPE, "--fp8.recipe", "tensorwise", "--parallel.tp", "2", "--parallel.cp", "2",
                                    "--parallel.recompute", "full"],
    "tp2-cp2-fp8-rowwise-full": [*FP8_SHAPE, "--fp8.recipe", "rowwise", "--parallel.tp", "2", "--parallel.cp", "2",
                                 "--parallel.recompute", "full"],
    # DeepSeek-V3 (tests/test_deepseek_v3_layouts.py's tiny model): latent attention's projections and
    # norms, its core over qk channels with values of v_head_dim, shared experts, the MTP module's
    # projection, MoE layer and head (its routers' statistics, its all-to-alls, never recomputed)
    "deepseek-v3-dp2-ep2-mtp": [*DS, *MTP, "--parallel.dp", "2", "--parallel.ep", "2"],
    "deepseek-v3-dp2-full-no-q-lora": [*DS, "--model.q_lora_rank", "0", "--parallel.dp", "2",
                                       "--parallel.recompute", "full"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dry_run_traffic_and_flops_equal_the_planner(name, tmp_path):
    cfg = make_config(str(tmp_path), *LAYOUTS[name])
    ranks = default_ranks(cfg)
    runs = dry_run(cfg, ranks, steps=2)
    assert [r.rank for r in runs] == [r for r, _ in ranks]
    for r in runs:
        assert r.traffic and r.traffic == r.traffic_planned, f"rank {r.rank}"
        assert r.flops > 0 and r.flops == r.flops_planned, f"rank {r.rank}"
        if cfg.parallel.pp > 1:  # a stage holds its own layers' weights only, as the planner counts
            assert r.memory["params"] == r.memory_planned["params"], f"rank {r.rank}"
    assert not dist.is_initialized()


def test_mesh_of_16384_ranks_builds_on_the_fake_process_group():
    """Llama 3's long-context layout (tp8 pp16 cp16 dp8): the last rank's groups are the ones
    ParallelDims computes (pp stride 1024, dp x cp of 128), built in one process."""
    from hybridpar import compat
    from hybridpar.distributed.mesh import ParallelDims

    dims = ParallelDims(dp=8, tp=8, pp=16, cp=16)
    compat.init_fake_process_group(16383, dims.world_size)
    try:
        with dims.build("cpu") as topo:
            for name in ("pp", "dp", "cp", "tp"):
                axis = topo.axis(name)
                assert axis.ranks == tuple(next(g for g in dims.group_ranks(name) if 16383 in g))
                assert axis.rank == axis.size - 1
            assert topo.pp.ranks[:2] == (1023, 2047) and topo.dp_cp.size == 128
    finally:
        dist.destroy_process_group()


def test_default_ranks_are_the_ones_that_differ(tmp_path):
    cfg = make_config(str(tmp_path), "--parallel.dp", "2", "--parallel.pp", "4", "--parallel.tp", "2",
                      "--model.n_layers", "4")
    why = dict(default_ranks(cfg))
    assert set(why) == {0, 12, 8, 15}  # first, last, middle (pp 2) stage; the last stage's last dp/tp coordinate
    assert "last pipeline stage" in why[12] and "middle" in why[8] and "remainder" in why[15]


def test_refused_layout_fails_with_the_rules_message_before_anything_is_built(capsys):
    """tp = 3 does not divide 8 heads: the rule's one line, no process group, nothing built."""
    with pytest.raises(ConfigError, match="n_heads") as e:
        cmd_dry_run(["--dry-run", "--parallel.tp", "3"])
    assert "\n" not in str(e.value)
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="--world 16 != dp \\* tp \\* pp \\* cp"):
        cmd_dry_run(["--dry-run", "--world", "16", "--parallel.dp", "2"])


def test_cli_json_reports_each_rank_beside_the_planner(tmp_path, capsys):
    assert cmd_dry_run(["--dry-run", "--json", "--ranks", "1", "--parallel.dp", "2", "--train.run_dir", str(tmp_path),
                        "--model.n_layers", "2", "--model.dim", "32", "--model.n_heads", "4", "--model.ffn_hidden", "64",
                        "--train.seq_len", "32", "--model.max_seq_len", "64"]) == 0
    out = json.loads(capsys.readouterr().out)
    (rank,) = out["ranks"]
    assert rank["rank"] == 1 and rank["traffic_diff"] == {"dp": 0} and rank["flops_diff"] == 0
    assert rank["memory"]["total"] > 0 and rank["memory_planned"]["tensors"] > 0


ZERO3_SHAPE = ["--model.vocab_size", "1024", "--train.seq_len", "64", "--model.max_seq_len", "64"]
PP_FULL_SHAPE = ["--model.dim", "64", "--model.ffn_hidden", "256", "--train.seq_len", "64", "--train.precision", "bf16",
                 "--parallel.tp", "2", "--parallel.cp", "2", "--parallel.pp", "2", "--parallel.sequence_parallel", "true",
                 "--parallel.recompute", "full", "--train.global_batch", "8", "--train.micro_batch", "1"]
MEMORY = {  # layouts whose peak live tensor bytes the planner's tensor term gets within 2%
    "dp2-zero1": ["--parallel.dp", "2", "--parallel.zero_stage", "1"],
    "dp2-zero2-one-micro-batch": ["--parallel.dp", "2", "--parallel.zero_stage", "2", "--train.micro_batch", "4"],
    "tp2-sp-chunked-loss": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true",
                            "--train.loss_chunk_tokens", "16"],
    # ZeRO-3 with a vocabulary and tokens per micro-batch larger than the width, as at scale (the
    # loss's backward is the peak): no gathered layer is alive there; the chunked loss's backward
    # frees a chunk's gradient before the next chunk's logits (both were the -8% of dp2 ZeRO-3)
    "dp2-zero3-accumulating": [*ZERO3_SHAPE, "--parallel.dp", "2", "--parallel.zero_stage", "3"],
    "cp2-dp2-zero3-chunked-loss-bf16": [*ZERO3_SHAPE, "--parallel.cp", "2", "--parallel.dp", "2",
                                        "--parallel.zero_stage", "3", "--train.loss_chunk_tokens", "32",
                                        "--train.precision", "bf16"],
    # FP8 linears save 1-byte quantized inputs and weights (tensorwise) or the bf16 input itself
    # (rowwise) where autocast kept bf16 casts (planner/memory/activations.py: fp8_layer_delta)
    "tp2-sp-fp8-tensorwise": [*FP8_SHAPE, "--fp8.recipe", "tensorwise", "--parallel.tp", "2",
                              "--parallel.sequence_parallel", "true"],
    "tp2-sp-fp8-rowwise": [*FP8_SHAPE, "--fp8.recipe", "rowwise", "--parallel.tp", "2",
                           "--parallel.sequence_parallel", "true"],
    # the expert dispatch's buffers are not alive at the loss's backward (planner/memory/comm.py)
    "moe-ep2-dp2": [*ZERO3_SHAPE, *LAYOUTS["moe-ep2-chunked-loss"][:8], "--parallel.dp", "2", "--parallel.ep", "2"],
    # full recompute under autocast with pp, cp and SP (the 405B long-context row's shape): no weight
    # casts per micro-batch in flight; the recomputed layer's casts and first fp32 weight gradient at
    # its backward (2 layers a stage), or the chunk's casts at the end of its forward (4 layers)
    **{f"tp2-cp2-pp2-sp-full-bf16-{n}-layers": [*PP_FULL_SHAPE, "--model.n_layers", str(n)] for n in (4, 8)},
    "deepseek-v3-dp2": [*DS, "--parallel.dp", "2"],  # latent attention's saved tensors, MoE with shared experts
    "deepseek-v3-dp2-mtp": [*DS, *MTP, "--parallel.dp", "2"],  # the MTP module's activations on the head's rank
}


@pytest.mark.parametrize("name", list(MEMORY))
def test_dry_run_peak_live_bytes_within_2_percent_of_the_planner(name, tmp_path):
    """No gradient-bucket or tp buffer beside the gradients and activations; ZeRO-2's reduced
    shard after the peak; the chunked loss's backward (planner/activations.py); ZeRO-3's gathered
    layers and ring attention's blocks not alive at the loss (planner/memory/comm.py)."""
    cfg = make_config(str(tmp_path), *MEMORY[name])
    (run,) = dry_run(cfg, [(0, "rank 0")], steps=2)
    assert run.memory["total"] == pytest.approx(run.memory_planned["tensors"], rel=0.02)
