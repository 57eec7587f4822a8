"""Config loading and the one layout validator: pure logic, no process group."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpar.config import (
    MODEL_PRESETS,
    Config,
    ConfigError,
    config_warnings,
    load_config,
    model_preset,
    parse_overrides,
    validate,
)


def write(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_defaults_are_the_tiny_preset_and_valid():
    cfg = load_config()
    assert cfg.model == model_preset("tiny")
    assert cfg.parallel.world_size == 1
    validate(cfg, world_size=1)


def test_toml_then_overrides(tmp_path):
    path = write(tmp_path, "[train]\nsteps = 7\nlr = 1e-3\n[parallel]\ndp = 2\n")
    cfg = load_config(path, ["--train.steps", "9", "--train.precision=bf16"])
    assert cfg.train.steps == 9 and cfg.train.lr == 1e-3 and cfg.parallel.dp == 2
    assert cfg.train.precision == "bf16"


def test_toml_int_accepted_for_float_field(tmp_path):
    cfg = load_config(write(tmp_path, "[train]\nlr = 1\nmin_lr = 0\n"))
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)


def test_preset_then_refinement_in_either_order():
    cfg = load_config(None, ["--model.n_layers", "4", "--model.preset", "llama3-8b"])
    assert cfg.model.dim == 4096 and cfg.model.n_layers == 4


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--train.stepz", "3"], "train.stepz"),
        (["--training.steps", "3"], "[training]"),
        (["--train.steps", "three"], "train.steps = 'three' must be an integer"),
        (["--train.lr", "fast"], "train.lr = 'fast' must be a number"),
        (["--parallel.sequence_parallel", "maybe"], "parallel.sequence_parallel"),
        (["--train.precision", "fp8"], "train.precision = 'fp8' is not allowed"),
        (["--model.preset", "gpt5"], "model.preset = 'gpt5' is unknown"),
        (["--train.steps"], "needs a value"),
        (["steps=3"], "unexpected argument"),
    ],
)
def test_bad_overrides_name_the_key(args, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, args)
    assert needle in str(err.value)


def test_toml_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="train.steps = '10' must be an integer"):
        load_config(write(tmp_path, '[train]\nsteps = "10"\n'))
    with pytest.raises(ConfigError, match=r"unknown config section \[optim\]"):
        load_config(write(tmp_path, "[optim]\nlr = 1\n"))
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[train\n"))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--train.global_batch", "12", "--parallel.dp", "2", "--train.micro_batch", "4"],
         "global_batch = 12 is not divisible by parallel.dp * train.micro_batch = 2 * 4 = 8"),
        (["--model.n_heads", "6", "--model.n_kv_heads", "4", "--model.dim", "96"],
         "n_heads = 6 must be a multiple of model.n_kv_heads = 4"),
        (["--model.dim", "100"], "model.dim = 100 is not divisible by model.n_heads = 8"),
        (["--train.seq_len", "2048"], "train.seq_len = 2048 exceeds model.max_seq_len = 1024"),
        (["--parallel.tp", "8"], "model.n_kv_heads = 4 < parallel.tp = 8"),
        (["--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--train.seq_len", "127"],
         "train.seq_len = 127 is not divisible by 2 (sequence parallelism"),
        (["--parallel.pp", "9"], "model.n_layers = 8 < parallel.pp * virtual_stages = 9 * 1 = 9 pipeline chunks"),
        (["--parallel.pp", "2", "--parallel.pipeline_schedule", "interleaved", "--parallel.virtual_stages", "2",
          "--train.global_batch", "24"], "interleaved 1F1B needs micro-batches per step divisible by parallel.pp: 3 % 2 = 1"),
        (["--parallel.microbatches", "4"], "parallel.microbatches = 4 but global_batch / (dp * micro_batch)"),
        (["--parallel.virtual_stages", "2"], "needs parallel.pipeline_schedule = 'interleaved'"),
        (["--parallel.cp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--train.seq_len", "132"],
         "train.seq_len = 132 is not divisible by 8 (sequence parallelism splits each sequence chunk"),
        (["--parallel.grad_compression", "fp16"], "parallel.grad_compression = 'fp16' needs parallel.zero_stage >= 1"),
        (["--model.preset", "tiny-moe", "--parallel.zero_stage", "3", "--parallel.pp", "2", "--parallel.dp", "2",
          "--parallel.ep", "2"], "parallel.zero_stage = 3 with parallel.pp = 2 and parallel.ep = 2 is not supported"),
        (["--parallel.offload_optimizer", "true"], "parallel.offload_optimizer = true needs parallel.zero_stage >= 1"),
        (["--parallel.zero_stage", "5"], "zero_stage = 5 must be 0, 1, 2 or 3"),
        (["--parallel.dp", "0"], "parallel.dp = 0 must be >= 1"),
        (["--train.min_lr", "1.0"], "min_lr"),
    ],
)
def test_layout_rules_show_numbers(args, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, args)
    assert needle in str(err.value)


def test_rules_checked_before_their_axis_is_built():
    """Shape rules for axes not built yet still report the numbers, ahead of 'not implemented'."""
    cfg = Config()
    cfg.parallel.tp = 3
    with pytest.raises(ConfigError, match="n_heads = 8 is not divisible by parallel.tp = 3"):
        validate(cfg)
    cfg = Config()
    cfg.parallel.cp = 3
    with pytest.raises(ConfigError, match="seq_len = 128 is not divisible by 2 \\* parallel.cp = 6"):
        validate(cfg)


def test_sequence_parallel_without_tp_is_a_warning_not_an_error():
    cfg = load_config(None, ["--parallel.sequence_parallel", "true"])
    assert config_warnings(cfg) == ["parallel.sequence_parallel = true has no effect with parallel.tp = 1; ignored"]


def test_world_size_mismatch_names_both_numbers():
    cfg = load_config(None, ["--parallel.dp", "2"])
    with pytest.raises(ConfigError, match=r"world size 3 != dp \* tp \* pp \* cp = 2 \* 1 \* 1 \* 1 = 2"):
        validate(cfg, world_size=3)


def test_parse_overrides_forms():
    assert parse_overrides(["--a.b", "1", "--c.d=x=y"]) == [("a.b", "1"), ("c.d", "x=y")]


def test_presets_match_published_parameter_counts():
    published = {"llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "llama3-405b": 405.9e9, "gpt3-175b": 174.6e9}
    for name, count in published.items():
        assert math.isclose(model_preset(name).num_params(), count, rel_tol=0.005), name


def test_tiny_admits_every_layout_up_to_16_ranks():
    tiny = MODEL_PRESETS["tiny"]
    for tp in (1, 2, 4):
        assert tiny["n_heads"] % tp == 0 and tiny["n_kv_heads"] % tp == 0 and tiny["ffn_hidden"] % tp == 0
    for pp in (1, 2, 4, 8):
        assert tiny["n_layers"] % pp == 0
    assert tiny["n_layers"] >= 8 and model_preset("tiny").num_params() < 5e6


def test_flops_per_token_formula():
    m = model_preset("llama3-8b")
    # 6N (N without the input embedding and norms) + 12 * L * d * s
    n = m.num_params() - m.vocab_size * m.dim - m.dim * (2 * m.n_layers + 1)
    assert m.flops_per_token(4096) == 6 * n + 12 * m.n_layers * m.dim * 4096


@settings(max_examples=200, deadline=None)
@given(dp=st.integers(1, 8), micro=st.integers(1, 8), batch=st.integers(1, 128))
def test_batch_rule_is_exactly_divisibility(dp, micro, batch):
    cfg = Config()
    cfg.parallel.dp, cfg.train.micro_batch, cfg.train.global_batch = dp, micro, batch
    ok = batch % (dp * micro) == 0
    if ok:
        validate(cfg, world_size=dp)
    else:
        with pytest.raises(ConfigError, match="global_batch"):
            validate(cfg, world_size=dp)
