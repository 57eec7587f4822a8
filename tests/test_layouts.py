"""The central promise: every supported layout trains the same model as one process.

Each layout runs a few steps of the small model and is compared with the single-process run by
the layout tolerance rule of :mod:`numerics` (per-step losses to 1e-5 relative, final gathered
weights to an absolute 1% of lr x steps; see there why).
"""

from __future__ import annotations

import pytest
import torch
from layouts import (
    LR,
    STEPS,
    Run,
    assert_trains_like,
    make_config,
    reference,
    train_layout,
    trainer_for,
)
from numerics import layout_weight_atol

pytestmark = pytest.mark.numerics  # layout equality: also run under other ATEN_CPU_CAPABILITY (Makefile)

WEIGHT_ATOL = layout_weight_atol(LR, STEPS)
# kv heads 4 and 8 layers everywhere, so tp4 and pp4 x V2 layouts share the reference model
MODEL = ("--model.n_kv_heads", "4", "--model.n_layers", "8")

LAYOUTS = {
    "dp2": ["--parallel.dp", "2"],
    "tp2": ["--parallel.tp", "2"],
    "tp2-sp": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    "cp2": ["--parallel.cp", "2"],
    "dp4": ["--parallel.dp", "4"],
    "tp4": ["--parallel.tp", "4", "--model.n_kv_heads", "4"],
    "tp4-sp": ["--parallel.tp", "4", "--model.n_kv_heads", "4", "--parallel.sequence_parallel", "true"],
    "cp4": ["--parallel.cp", "4"],
    "dp2-tp2": ["--parallel.dp", "2", "--parallel.tp", "2"],
    "dp2-tp2-sp": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    "dp2-cp2": ["--parallel.dp", "2", "--parallel.cp", "2"],
    "cp2-tp2": ["--parallel.cp", "2", "--parallel.tp", "2"],
    "cp2-tp2-sp": ["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    "pp2-cp2-tp2-sp": ["--parallel.pp", "2", "--parallel.cp", "2", "--parallel.tp", "2",
                       "--parallel.sequence_parallel", "true"],
    "dp2-cp2-tp2-sp-zero1": ["--parallel.dp", "2", "--parallel.cp", "2", "--parallel.tp", "2",
                             "--parallel.sequence_parallel", "true", "--parallel.zero_stage", "1"],
    "pp2": ["--parallel.pp", "2"],
    "pp2-gpipe": ["--parallel.pp", "2", "--parallel.pipeline_schedule", "gpipe"],
    "pp2-interleaved": ["--parallel.pp", "2", "--parallel.pipeline_schedule", "interleaved",
                        "--parallel.virtual_stages", "2"],
    "pp2-zb": ["--parallel.pp", "2", "--parallel.pipeline_schedule", "zb-h1"],
    "pp4": ["--parallel.pp", "4"],
    "pp2-zbv": ["--parallel.pp", "2", "--parallel.pipeline_schedule", "zbv", "--parallel.virtual_stages", "2"],
    "pp4-zbv": ["--parallel.pp", "4", "--parallel.pipeline_schedule", "zbv", "--parallel.virtual_stages", "2"],
    "dp2-pp2-zbv-tp2": ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.tp", "2",
                        "--parallel.pipeline_schedule", "zbv", "--parallel.virtual_stages", "2"],
    "pp2-interleaved-stage-layers": ["--parallel.pp", "2", "--parallel.pipeline_schedule", "interleaved",
                                     "--parallel.virtual_stages", "2", "--parallel.stage_layers", "1,3,3,1"],
    "pp2-zbv-stage-layers": ["--parallel.pp", "2", "--parallel.pipeline_schedule", "zbv", "--parallel.virtual_stages",
                             "2", "--parallel.stage_layers", "3,1,2,2"],
    "pp4-gpipe": ["--parallel.pp", "4", "--parallel.pipeline_schedule", "gpipe"],
    "pp4-interleaved": ["--parallel.pp", "4", "--parallel.pipeline_schedule", "interleaved",
                        "--parallel.virtual_stages", "2"],
    "pp4-zb": ["--parallel.pp", "4", "--parallel.pipeline_schedule", "zb-h1"],
    "dp2-pp2": ["--parallel.dp", "2", "--parallel.pp", "2"],
    "pp2-tp2-sp": ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true"],
    "dp2-tp2-pp2": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2"],
    "dp2-tp2-pp2-interleaved-sp": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2",
                                   "--parallel.pipeline_schedule", "interleaved", "--parallel.virtual_stages", "2",
                                   "--parallel.sequence_parallel", "true"],
    "pp2-cp2": ["--parallel.pp", "2", "--parallel.cp", "2"],
    "dp2-tp2-pp2-cp2": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2", "--parallel.cp", "2"],
    "dp2-tp2-pp2-cp2-zb": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2", "--parallel.cp", "2",
                           "--parallel.pipeline_schedule", "zb-h1"],
    "dp4-hierarchical": ["--parallel.dp", "4", "--parallel.hierarchical_dp", "true", "--parallel.node_size", "2"],
    "dp2-cp2-hierarchical": ["--parallel.dp", "2", "--parallel.cp", "2", "--parallel.hierarchical_dp", "true",
                             "--parallel.node_size", "2"],
    "dp2-zero1": ["--parallel.dp", "2", "--parallel.zero_stage", "1"],
    "dp2-zero2": ["--parallel.dp", "2", "--parallel.zero_stage", "2"],
    "dp2-zero3": ["--parallel.dp", "2", "--parallel.zero_stage", "3"],
    "dp4-zero3-offload": ["--parallel.dp", "4", "--parallel.zero_stage", "3", "--parallel.offload_optimizer", "true"],
    # ZeRO-Infinity: optimizer state (and ZeRO-3 parameter shards) in memory-mapped files
    "dp2-zero2-offload-disk": ["--parallel.dp", "2", "--parallel.zero_stage", "2", "--parallel.offload_optimizer", "true",
                               "--parallel.offload_to", "disk"],
    "dp2-zero3-offload-disk-params": ["--parallel.dp", "2", "--parallel.zero_stage", "3", "--parallel.offload_optimizer",
                                      "true", "--parallel.offload_to", "disk", "--parallel.offload_params", "true"],
    "dp2-zero3-offload-params": ["--parallel.dp", "2", "--parallel.zero_stage", "3", "--parallel.offload_optimizer",
                                 "true", "--parallel.offload_params", "true"],
    # ZeRO composed with the other axes: it shards over dp x cp, rows of each tp piece, per stage
    "dp2-tp2-sp-zero1": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true",
                         "--parallel.zero_stage", "1"],
    "dp2-tp2-zero3": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.zero_stage", "3"],
    "dp2-cp2-zero2": ["--parallel.dp", "2", "--parallel.cp", "2", "--parallel.zero_stage", "2"],
    "dp2-pp2-zero1": ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.zero_stage", "1"],
    "dp2-pp2-zb-zero2": ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.pipeline_schedule", "zb-h1",
                         "--parallel.zero_stage", "2"],
    "dp2-tp2-pp2-zero2": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2", "--parallel.zero_stage", "2"],
    # ZeRO-3 x pp: each chunk gathered once per step, reduce-scattered after its last backward (or W)
    "dp2-pp2-zero3": ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.zero_stage", "3"],
    "dp2-pp2-interleaved-zero3": ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.pipeline_schedule",
                                  "interleaved", "--parallel.virtual_stages", "2", "--parallel.zero_stage", "3"],
    "dp2-pp2-zb-zero3": ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.pipeline_schedule", "zb-h1",
                         "--parallel.zero_stage", "3"],
    "dp2-pp2-zbv-zero3": ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.pipeline_schedule", "zbv",
                          "--parallel.virtual_stages", "2", "--parallel.zero_stage", "3"],
    "dp2-tp2-pp2-zero3": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2", "--parallel.zero_stage", "3"],
    # activation recomputation reruns forwards (their collectives included) inside backward
    "recompute-full": ["--parallel.recompute", "full"],
    "dp2-tp2-sp-recompute-full": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true",
                                  "--parallel.recompute", "full"],
    "cp2-recompute-selective": ["--parallel.cp", "2", "--parallel.recompute", "selective"],
    "dp2-zero3-recompute-full": ["--parallel.dp", "2", "--parallel.zero_stage", "3", "--parallel.recompute", "full"],
    "pp2-zb-recompute-full": ["--parallel.pp", "2", "--parallel.pipeline_schedule", "zb-h1",
                              "--parallel.recompute", "full"],
    "dp2-tp2-pp2-cp2-recompute-full": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.pp", "2",
                                       "--parallel.cp", "2", "--parallel.recompute", "full"],
    # the chunked head + loss (64 tokens a micro-batch, cp2: 32 a rank, in chunks of 24) against the unchunked run
    "chunked-loss": ["--train.loss_chunk_tokens", "24"],
    "tp2-sp-chunked-loss": ["--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--train.loss_chunk_tokens", "24"],
    "cp2-tp2-chunked-loss": ["--parallel.cp", "2", "--parallel.tp", "2", "--train.loss_chunk_tokens", "24"],
    "pp2-zb-chunked-loss": ["--parallel.pp", "2", "--parallel.pipeline_schedule", "zb-h1", "--train.loss_chunk_tokens", "24"],
    "dp2-pp2-zero3-chunked-loss": ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.zero_stage", "3",
                                   "--train.loss_chunk_tokens", "24"],
    "dp2-zero3-chunked-loss": ["--parallel.dp", "2", "--parallel.zero_stage", "3", "--train.loss_chunk_tokens", "24"],
    "recompute-full-chunked-loss": ["--parallel.recompute", "full", "--train.loss_chunk_tokens", "24"],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "layouts")
    results = train_layout(Run(tmp, (*MODEL, *LAYOUTS[name])))
    assert_trains_like(results, reference(Run(tmp, MODEL)), atol=WEIGHT_ATOL)


# fp16 with dynamic loss scaling: the scale starts high enough that a step overflows, and grows
# every 2 clean steps. Every layout must scale, skip and grow exactly as one process does (each
# rank scales its micro-batches as one process scales the whole batch, so the same values
# overflow fp16), and then train the same weights (ZeRO unscales its shards of the gradients).
# Tolerances: tp and cp split matmuls whose fp16 outputs then round differently, so losses are
# held to fp16's unit roundoff 2^-11 relative (measured: 2e-5). Weights: those fp16 roundings
# (2^-11 of a gradient) reach every entry, and Adam turns them into up to its whole step lr in
# entries whose gradient cancels to noise, so each tensor's training update (weights minus
# initial weights) is held to 5% relative L2 of one process's, and every entry to Adam's bound
# of 1.2 lr per step (|m| / sqrt(v) <= (1 - b1) / sqrt((1 - b2)(1 - b1^2 / b2)) = 1.17 at
# b1 = 0.9, b2 = 0.95). A layout bug (a lost reduction, a wrong scale) changes updates by O(1).
FP16 = ["--train.precision", "fp16", "--train.loss_scale_init", "131072", "--train.loss_scale_window", "2"]
FP16_STEPS = 5
FP16_LAYOUTS = ["dp2", "dp2-zero1", "dp2-zero2", "dp2-zero3", "dp4-zero3-offload", "dp2-cp2-zero2",
                "dp2-tp2-sp-zero1", "dp2-pp2-zero1"]


@pytest.mark.parametrize("name", FP16_LAYOUTS)
def test_fp16_layout_matches_single_process(name, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / "layouts-fp16")
    ref = reference(Run(tmp, (*MODEL, *FP16), FP16_STEPS))
    init = reference(Run(tmp, (*MODEL, *FP16), 0)).state
    assert any(ref.skipped) and not all(ref.skipped)  # an overflow is skipped, the others step
    assert max(ref.scales) > ref.scales[0]  # and the scale grows
    results = train_layout(Run(tmp, (*MODEL, *LAYOUTS[name], *FP16), FP16_STEPS))
    for rank, r in enumerate(results):
        assert (r.skipped, r.scales) == (ref.skipped, ref.scales), f"rank {rank}"
    assert_trains_like(results, ref, atol=None, rel=2.0**-11)
    for k, v in results[0].state.items():
        update = ref.state[k] - init[k]
        assert float((v - ref.state[k]).norm()) <= 0.05 * float(update.norm()), k
        assert float((v - ref.state[k]).abs().max()) <= 1.2 * LR * FP16_STEPS, k


@pytest.mark.parametrize("saved, loaded", [("tp2", "tp4"), ("dp2-tp2", "one"), ("tp4-sp", "tp2"),
                                           ("dp4-zero3-offload", "dp2-zero1"), ("dp2-tp2-zero3", "dp2-tp2-pp2-zero2"),
                                           ("dp2-zero3-offload-disk-params", "dp2-zero2-offload-disk"),
                                           ("dp2-tp2-pp2-zero2", "tp2"), ("dp2-pp2-zbv-zero3", "dp2-zero1"),
                                           ("dp2-tp2-zero3", "dp2-pp2-interleaved-zero3")])
def test_checkpoint_reshards_across_layouts(saved, loaded, tmp_path):
    """Saved at step 2 under one layout, continued under another: same as never changing."""
    ref = reference(Run(str(tmp_path / "ref"), MODEL))
    train_layout(Run(str(tmp_path), (*MODEL, *LAYOUTS[saved]), steps=2, save_at=2))
    load_layout = [] if loaded == "one" else LAYOUTS[loaded]
    results = train_layout(Run(str(tmp_path), (*MODEL, *load_layout), resume_from=2), here_if_one=True)
    assert results[0].start == 2
    assert_trains_like(results, ref, atol=WEIGHT_ATOL)


def _hf_logits(rank: int, world: int, tmp: str, hf_dir: str, layout: list[str]) -> torch.Tensor:
    from hybridpar.parallel.tensor import gather_logits

    cfg = make_config(tmp, *MODEL, *layout, "--train.init_from", hf_dir)
    with trainer_for(cfg) as trainer:
        tokens = torch.arange(32).reshape(2, 16) % cfg.model.vocab_size
        with torch.no_grad():
            return gather_logits(trainer.model(tokens), trainer.topo.tp, cfg.model.vocab_size)


def test_hugging_face_weights_seed_a_tensor_parallel_run(tmp_path, dist_run):
    """Each tp rank reads only its slices of the safetensors file; the logits equal transformers'."""
    transformers = pytest.importorskip("transformers")
    from hybridpar.models.llama.hf import to_hf_config_dict

    cfg = make_config(str(tmp_path), *MODEL)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**to_hf_config_dict(cfg.model))).eval()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    tokens = torch.arange(32).reshape(2, 16) % cfg.model.vocab_size
    with torch.no_grad():
        expected = hf(tokens).logits
    for logits in dist_run(2, _hf_logits, str(tmp_path), str(tmp_path / "hf"), LAYOUTS["tp2-sp"]):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def _train_and_save(rank: int, world: int, tmp: str, layout: list[str]) -> None:
    flags = [*layout, "--train.steps", "2", "--train.eval_every", "0", "--train.sample_tokens", "4"]
    with trainer_for(make_config(tmp, *MODEL, *flags)) as trainer:
        trainer.fit()


def test_tensor_parallel_checkpoint_converts_to_hugging_face(tmp_path, dist_run):
    """`hybridpar convert` of a tp2 x pp2 checkpoint: transformers loads it, same logits."""
    transformers = pytest.importorskip("transformers")
    from hybridpar.cli import main
    from hybridpar.models.llama import Llama
    from hybridpar.training import checkpoint

    dist_run(4, _train_and_save, str(tmp_path), ["--parallel.tp", "2", "--parallel.pp", "2"])
    ckpt = checkpoint.latest_checkpoint(tmp_path)
    assert main(["convert", str(ckpt), "--to-hf", str(tmp_path / "hf")]) == 0
    cfg, state = checkpoint.load_model_state(ckpt)
    ours = Llama(cfg.model)
    ours.load_state_dict(state)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.arange(32).reshape(2, 16) % cfg.model.vocab_size
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)
