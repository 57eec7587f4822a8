"""The rule table: one place states each shape/layout rule, and every user of a rule asks it."""

from __future__ import annotations

import dataclasses

import pytest

from hybridpar.config import (
    Config,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    load_config,
    validate,
)
from hybridpar.planner.model.layout import Layout, Workload, layout_rule_error
from hybridpar.rules import RULES, first_broken, model_error, tp_split_error


def test_rule_names_are_unique_and_named_by_area():
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))
    assert all(n.split("-")[0] in {"model", "parallel", "hierarchical", "train", "seq", "dp", "tp", "pp",
                                   "virtual", "microbatches", "interleaved", "cp", "sp", "world", "offload", "ep",
                                   "zero3", "zero", "runtime"} for n in names)


@pytest.mark.parametrize(("overrides", "rule"), [
    (["--parallel.tp", "3"], "tp-divides-heads"),
    (["--parallel.tp", "8"], "tp-whole-kv-heads"),
    (["--parallel.pp", "16"], "pp-layer-per-chunk"),
    (["--parallel.cp", "2", "--parallel.sequence_parallel", "true", "--parallel.tp", "2", "--train.seq_len", "132"],
     "sp-seq-len"),
    (["--parallel.zero_stage", "3", "--parallel.pp", "2", "--parallel.dp", "2", "--parallel.ep", "2",
      "--model.family", "mixtral", "--model.n_experts", "4", "--model.experts_per_token", "2"], "zero3-pp-experts"),
    (["--model.family", "gpt2"], "model-gpt2-shape"),
])
def test_validate_raises_the_first_broken_rules_message(overrides, rule):
    cfg = load_config(None, [])
    for key, value in zip(overrides[::2], overrides[1::2], strict=True):
        section, _, name = key[2:].partition(".")
        target = getattr(cfg, section)
        kind = type(getattr(target, name))
        setattr(target, name, value == "true" if kind is bool else kind(value))
    broken = first_broken(cfg)
    assert broken is not None and broken[0].name == rule
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value) == broken[1]


def test_planner_reads_the_rule_not_a_parsed_message():
    model = ModelConfig()  # tiny: 8 heads
    work = Workload(global_batch=8, seq_len=64, precision="fp32")
    bad = Layout(dp=1, tp=3, pp=1, cp=1)
    cfg = Config(model=dataclasses.replace(model), parallel=ParallelConfig(tp=3),
                 train=TrainConfig(global_batch=8, micro_batch=1, seq_len=64))
    assert layout_rule_error(model, bad, work) == first_broken(cfg, 3)[1]
    assert layout_rule_error(model, Layout(dp=1, tp=2, pp=1, cp=1), work) is None


def test_families_check_the_same_tp_rules_as_validate():
    m = ModelConfig(n_heads=8, n_kv_heads=2, ffn_hidden=96)
    assert tp_split_error(m, 2) is None
    assert "every tp rank needs a whole KV head" in tp_split_error(m, 4)
    assert "ffn_hidden = 90" in tp_split_error(dataclasses.replace(m, n_kv_heads=4, ffn_hidden=90), 4)
    assert model_error(ModelConfig(family="gpt2")).startswith("model.n_kv_heads = 4 but model.n_heads = 8")
    assert model_error(ModelConfig(family="gpt2", n_kv_heads=8)) is None
