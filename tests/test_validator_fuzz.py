"""Fuzzing the validator: whatever it accepts, the runtime's own shape checks and the planner
accept too.

Every piece of the runtime that can refuse a shape (tensor-parallel split, pipeline partition
and schedule, context-parallel sequence split, micro-batching) is asked about each config the
validator accepted; none may fail. Configs it rejects get one ConfigError line with numbers.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from hybridpar.config import Config, ConfigError, validate
from hybridpar.models.llama.parallelize import check_tp_shape
from hybridpar.parallel.context import check_seq_len
from hybridpar.parallel.pipeline import build_schedule, partition_model
from hybridpar.planner.machine.hardware import Cluster, gpu_spec
from hybridpar.planner.model.layout import Layout, Workload, runtime_note
from hybridpar.planner.search.search import evaluate

pow2 = st.sampled_from([1, 2, 4, 8])


@st.composite
def configs(draw) -> Config:
    cfg = Config()
    m, p, t = cfg.model, cfg.parallel, cfg.train
    m.n_heads = draw(st.sampled_from([2, 3, 4, 6, 8, 12, 16]))
    # mostly sensible shapes (so many configs pass and reach the runtime checks), sometimes not
    divisors = [d for d in range(1, m.n_heads + 1) if m.n_heads % d == 0]
    m.n_kv_heads = draw(st.sampled_from(divisors * 4 + [3]))
    m.dim = m.n_heads * draw(st.sampled_from([2, 4, 8, 6] * 4 + [3]))
    m.ffn_hidden = draw(st.sampled_from([24, 32, 48, 64, 96]))
    m.n_layers = draw(st.integers(1, 16))
    m.vocab_size = draw(st.sampled_from([97, 256, 300]))
    p.dp, p.tp, p.pp, p.cp = draw(pow2), draw(st.sampled_from([1, 1, 2, 4])), draw(pow2), draw(st.sampled_from([1, 1, 2]))
    p.pipeline_schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1"]))
    p.virtual_stages = draw(st.sampled_from([1, 1, 2, 3]))
    p.sequence_parallel = draw(st.booleans())
    p.zero_stage = draw(st.sampled_from([0, 0, 0, 1, 2, 3]))
    p.microbatches = draw(st.sampled_from([0, 0, 0, 1, 2, 4]))
    t.seq_len = draw(st.sampled_from([8, 12, 16, 24, 32, 64]))
    t.micro_batch = draw(st.integers(1, 4))
    multiple = st.integers(1, 8).map(lambda k: k * p.dp * t.micro_batch)
    t.global_batch = draw(st.one_of(st.integers(1, 64), multiple, multiple, multiple))
    return cfg


@settings(max_examples=1500, deadline=None)
@given(cfg=configs())
def test_accepted_configs_pass_every_runtime_check(cfg: Config) -> None:
    try:
        validate(cfg)
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg, msg  # one line
        assert any(ch.isdigit() for ch in msg), msg  # shows the numbers
        event("rejected")
        return
    event("accepted")
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
    # the planner judges the same layout valid and can evaluate it (memory and time)
    layout = Layout(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, zero_stage=p.zero_stage,
                    offload_optimizer=p.offload_optimizer, pipeline_schedule=p.pipeline_schedule,
                    virtual_stages=p.virtual_stages, sequence_parallel=p.sequence_parallel,
                    recompute=p.recompute, micro_batch=t.micro_batch)
    work = Workload(global_batch=t.global_batch, seq_len=t.seq_len, precision=t.precision, half_params=False)
    assert runtime_note(m, layout, work) is None
    ev = evaluate(m, layout, work, Cluster.of(gpu_spec("H100-SXM"), layout.world_size))
    assert ev.rule is None, ev.rule
    assert ev.memory is not None and ev.cost is not None
