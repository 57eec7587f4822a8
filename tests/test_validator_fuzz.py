"""Fuzzing the validator: whatever it accepts, the runtime's own shape checks accept too.

Every piece of the runtime that can refuse a shape (tensor-parallel split, pipeline partition
and schedule, context-parallel sequence split, micro-batching) is asked about each config the
validator accepted; none may fail. Configs it rejects get one ConfigError line with numbers.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridpar.config import Config, ConfigError, validate
from hybridpar.parallel.context import check_seq_len
from hybridpar.parallel.pipeline import build_schedule, partition_model
from hybridpar.parallel.tensor_plan import check_tp_shape

pow2 = st.sampled_from([1, 2, 4, 8])


@st.composite
def configs(draw) -> Config:
    cfg = Config()
    m, p, t = cfg.model, cfg.parallel, cfg.train
    m.n_heads = draw(st.sampled_from([2, 3, 4, 6, 8, 12, 16]))
    m.n_kv_heads = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    m.dim = m.n_heads * draw(st.sampled_from([2, 4, 8, 6]))
    m.ffn_hidden = draw(st.sampled_from([24, 32, 48, 64, 96]))
    m.n_layers = draw(st.integers(1, 12))
    m.vocab_size = draw(st.sampled_from([97, 256, 300]))
    p.dp, p.tp, p.pp, p.cp = draw(pow2), draw(pow2), draw(pow2), draw(pow2)
    p.pipeline_schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]))
    p.virtual_stages = draw(st.sampled_from([1, 1, 2, 3]))
    p.sequence_parallel = draw(st.booleans())
    p.microbatches = draw(st.sampled_from([0, 0, 1, 2, 4]))
    t.seq_len = draw(st.sampled_from([8, 12, 16, 24, 32, 64]))
    t.micro_batch = draw(st.integers(1, 4))
    t.global_batch = draw(st.integers(1, 64))
    return cfg


@settings(max_examples=600, deadline=None)
@given(cfg=configs())
def test_accepted_configs_pass_every_runtime_check(cfg: Config) -> None:
    try:
        validate(cfg)
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg, msg  # one line
        assert any(ch.isdigit() for ch in msg), msg  # shows the numbers
        return
    m, p, t = cfg.model, cfg.parallel, cfg.train
    check_tp_shape(m, p.tp)
    check_seq_len(t.seq_len, p.cp)
    if p.sequence_parallel and p.tp > 1:
        assert (t.seq_len // (2 * p.cp if p.cp > 1 else 1)) % p.tp == 0
    micro = t.global_batch // (p.dp * t.micro_batch)
    assert micro * p.dp * t.micro_batch == t.global_batch and micro >= 1
    if p.pp > 1:
        partition_model(m, p.pp, p.virtual_stages)
        build_schedule(p.pipeline_schedule, p.pp, p.virtual_stages, micro)
