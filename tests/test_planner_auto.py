"""Calibrated hardware profiles and ``train --parallel.auto``: the profile round-trips through
TOML, the cost model prices GEMMs, attention and collectives with its measured rates, and the
auto layout is one the trainer accepts. No timings are asserted (see benchmarks/planner_time.py)."""

from __future__ import annotations

import dataclasses

import pytest

from hybridpar.config import Config, ConfigError, validate
from hybridpar.planner.front.auto import (
    CHOSEN,
    CPU_CORE,
    apply_layout,
    choose_layout,
    layout_overrides,
)
from hybridpar.planner.machine import calibrate as cal
from hybridpar.planner.machine.hardware import Calibration, Cluster, CommFit, PlanError, gpu_spec
from hybridpar.planner.model.layout import Layout, Workload
from hybridpar.planner.price.cost import gemm_backward_time, gemm_time, layer_time, step_cost

DIMS = (32, 128, 512)


def _rate(m: float, n: float, k: float) -> float:
    """A made-up but shape-dependent GEMM rate (FLOP/s)."""
    return 1e9 * (1 + m / 512) * (1 + n / 1024) * (1 + k / 2048)


def write_profile(path, comm=True, **extra) -> None:
    gemm = [[m, n, k, _rate(m, n, k)] for m in DIMS for n in DIMS for k in DIMS]
    attention = [[s, d, 2e9 * s / 64, 1e9 * s / 64] for s in (64, 256) for d in (16, 64)]
    fits = [{"op": op, "size": 2, "alpha": 1e-4, "beta": 1e-9, "points": [[1.0, 1e-4]]}
            for op in ("all_reduce", "all_gather", "reduce_scatter", "send")] if comm else []
    gpu = {"name": "test cpu", "bf16_flops": 3e9, "fp32_flops": 3e9, "hbm_bytes": 8e9, "hbm_bw": 1e10,
           "intra_bw": 1e9, "inter_bw": 1e9, "intra_latency": 5e-5, "inter_latency": 5e-5,
           "gemm_efficiency": 1.0, "comm_efficiency": 1.0, "launch_overhead": 2e-6, "host_bw": 1e10}
    meta = {"device": "cpu", "dtype": "fp32", "backend": "gloo", "threads": 1, "source": "test",
            "gemm": gemm, "attention": attention, **extra}
    path.write_text(cal.to_toml(gpu, meta, fits, "test profile\nsecond line"))


def test_profile_round_trips(tmp_path):
    f = tmp_path / "hw.toml"
    write_profile(f)
    spec = gpu_spec(str(f))
    c = spec.calibration
    assert spec.name == "test cpu" and spec.hbm_bw == 1e10 and c is not None
    assert (c.device, c.dtype, c.backend, c.threads) == ("cpu", "fp32", "gloo", 1)
    assert len(c.gemm) == 27 and len(c.attention) == 4 and len(c.comm) == 4
    assert c.comm[0] == CommFit("all_reduce", 2, 1e-4, 1e-9)
    # measured grid points come back exactly; between them the log-rate is interpolated
    assert c.gemm_rate(128, 32, 512) == pytest.approx(_rate(128, 32, 512))
    mid = c.gemm_rate(256, 128, 128)
    assert _rate(128, 128, 128) < mid < _rate(512, 128, 128)
    # beyond the grid: the edge rate; below it the time of the smallest call
    assert c.gemm_rate(4096, 512, 512) == pytest.approx(_rate(512, 512, 512))
    assert c.gemm_rate(8, 32, 32) == pytest.approx(_rate(32, 32, 32) * 8 / 32)
    assert c.attention_rates(64, 16) == pytest.approx((2e9, 1e9))


def test_cost_model_uses_calibrated_rates(tmp_path):
    f = tmp_path / "hw.toml"
    write_profile(f)
    spec = gpu_spec(str(f))
    m, n, k = 128, 512, 32
    assert gemm_time(m, n, k, spec, 4) == pytest.approx(2 * m * n * k / _rate(m, n, k))
    dx, dw = gemm_backward_time(m, n, k, spec, 4)
    assert dx == pytest.approx(2 * m * n * k / _rate(m, k, n)) and dw == pytest.approx(2 * m * n * k / _rate(k, n, m))
    cluster = Cluster.of(spec, 2, 2)
    assert cluster.collective_time("all_reduce", 1e6, 2, 1) == pytest.approx(1e-4 + 1e-3)
    assert cluster.collective_time("send", 1e6, 2, 1) == pytest.approx(1e-4 + 1e-3)
    # carried to 4 ranks by the ring's step and byte counts: 3x the steps, 1.5x the bytes
    assert Cluster.of(spec, 4, 4).collective_time("all_reduce", 1e6, 4, 1) == pytest.approx(3e-4 + 1.5e-3)
    # the same layout is slower with slower measured GEMMs and faster collectives change tp time
    from hybridpar.config import model_preset

    tiny, work = model_preset("tiny"), Workload(16, 128, "fp32", half_params=False)
    base = layer_time(tiny, Layout(tp=2, micro_batch=8), work, cluster)
    slow = dataclasses.replace(spec, calibration=dataclasses.replace(
        spec.calibration, gemm=tuple((a, b, c, r / 2) for a, b, c, r in spec.calibration.gemm)))
    assert layer_time(tiny, Layout(tp=2, micro_batch=8), work, Cluster.of(slow, 2, 2)).w == pytest.approx(2 * base.w)
    assert base.tp_comm == pytest.approx(4 * cluster.collective_time("all_reduce", 8 * 128 * 128 * 4, 2, 1))
    assert step_cost(tiny, Layout(dp=2, micro_batch=8), work, cluster).step_time_s > 0
    # without a measured collective the ring formula over the [gpu] link numbers is used
    no_comm = tmp_path / "nocomm.toml"
    write_profile(no_comm, comm=False)
    ring = Cluster.of(gpu_spec(str(no_comm)), 2, 2).collective_time("all_reduce", 1e6, 2, 1)
    assert ring == pytest.approx(2 * 5e-5 + 1e6 / 1e9)


def test_shared_chip_terms(tmp_path):
    """Concurrency fractions slow each rank when its node is busy; the eager block's fixed cost and
    the measured compute/communication overlap enter the layer and step times."""
    from hybridpar.config import model_preset
    from hybridpar.planner.price.cost import overlap_fraction

    f = tmp_path / "hw.toml"
    write_profile(f, block=[1e-3, 2e-3], concurrency=[[2, 0.5, 0.25]], overlap=0.0)
    spec = gpu_spec(str(f))
    assert spec.calibration.block == (1e-3, 2e-3) and spec.calibration.overlap == 0.0
    one, two = Cluster.of(spec, 1, 1), Cluster.of(spec, 2, 2)
    assert one.rank_gpu is spec and two.rank_gpu.hbm_bw == pytest.approx(0.25 * spec.hbm_bw)
    assert gemm_time(128, 128, 128, two.rank_gpu, 4) == pytest.approx(2 * gemm_time(128, 128, 128, spec, 4))
    assert overlap_fraction(spec) == 0.0 and overlap_fraction(CPU_CORE) == 1.0
    tiny, work = model_preset("tiny"), Workload(16, 128, "fp32", half_params=False)
    lt = layer_time(tiny, Layout(micro_batch=8), work, one)
    plain = tmp_path / "plain.toml"
    write_profile(plain)
    base = layer_time(tiny, Layout(micro_batch=8), work, Cluster.of(gpu_spec(str(plain)), 1, 1))
    assert lt.f - base.f == pytest.approx(1e-3 - 26 * 2e-6) and lt.b - base.b == pytest.approx(2e-3 - 48 * 2e-6)
    # 1 MiB buckets: all but the last hide behind backward, unless the overlap measured is 0
    work = Workload(16, 128, "fp32", half_params=False, bucket_mb=1.0)
    hidden = step_cost(tiny, Layout(dp=2, micro_batch=8), work, Cluster.of(gpu_spec(str(plain)), 2, 2))
    exposed = step_cost(tiny, Layout(dp=2, micro_batch=8), work, Cluster.of(
        dataclasses.replace(spec, calibration=dataclasses.replace(spec.calibration, concurrency=())), 2, 2))
    assert exposed.terms["dp_exposed"] == pytest.approx(exposed.terms["dp_comm"])
    assert hidden.terms["dp_exposed"] < hidden.terms["dp_comm"]
    f.write_text(f.read_text().replace("overlap = 0.0", "overlap = 2.0"))
    with pytest.raises(PlanError, match="overlap"):
        gpu_spec(str(f))


def test_bad_profiles_are_plan_errors(tmp_path):
    f = tmp_path / "bad.toml"
    write_profile(f)
    text = f.read_text()
    f.write_text(text.replace("[calibration]", "[calibration]\nwhat = 1"))
    with pytest.raises(PlanError, match="unknown \\[calibration\\] keys"):
        gpu_spec(str(f))
    f.write_text(text.replace('op = "send"', 'op = "gossip"'))
    with pytest.raises(PlanError, match="gossip"):
        gpu_spec(str(f))
    with pytest.raises(PlanError, match="full grid"):
        Calibration(gemm=((32, 32, 32, 1e9), (64, 32, 32, 1e9), (32, 64, 32, 1e9)))


def test_fit_alpha_beta():
    points = [(b, 2e-4 + 3e-10 * b) for b in (1e3, 1e5, 1e6, 1e7)]
    alpha, beta = cal.fit_alpha_beta(points)
    assert alpha == pytest.approx(2e-4) and beta == pytest.approx(3e-10)


def test_calibrate_writes_a_loadable_profile(tmp_path, monkeypatch):
    """The whole command on a toy grid, collectives skipped (no processes spawned)."""
    toy = cal.Plan((16, 32), (16, 32), (8,), (1024,), 0.001, 1)
    monkeypatch.setattr(cal.Plan, "for_device", classmethod(lambda cls, device, quick: toy))
    lines: list[str] = []
    out = cal.calibrate(tmp_path / "p" / "hw.toml", nproc=1, quick=True, device_name="cpu", progress=lines.append)
    spec = gpu_spec(str(out))
    assert spec.calibration is not None and len(spec.calibration.gemm) == 8 and spec.fp32_flops > 0
    assert any("collectives: skipped" in line for line in lines)
    with pytest.raises(cal.CalibrateError, match="--nproc 0"):
        cal.calibrate(tmp_path / "x.toml", nproc=0, quick=True, device_name="cpu", progress=lines.append)


def test_auto_layout_is_runnable_and_explained(tmp_path):
    f = tmp_path / "hw.toml"
    write_profile(f)
    cfg = Config()
    cfg.parallel.auto = True
    cfg.train.hardware = str(f)
    for world in (1, 2, 4):
        choice = choose_layout(cfg, world)
        chosen = apply_layout(cfg, choice.best.layout)
        validate(chosen, world_size=world)  # what the trainer will check again
        assert not chosen.parallel.auto and chosen.parallel.world_size == world
        # only the planner's fields changed; the rest is the user's
        for key in ("sequence_parallel", "recompute", "offload_optimizer", "bucket_mb"):
            assert getattr(chosen.parallel, key) == getattr(cfg.parallel, key)
        assert dataclasses.replace(chosen.train, micro_batch=cfg.train.micro_batch) == cfg.train
        times = [e.cost.step_time_s for e in choice.ranked]
        assert times == sorted(times) and choice.best is choice.ranked[0]
        text = choice.explain()
        assert "chose" in text and choice.hardware in text and "s/step" in text
    pinned = layout_overrides(chosen)
    assert pinned[:2] == ["--parallel.auto", "false"] and len(pinned) == 2 + 2 * len(CHOSEN)


def test_auto_keeps_the_layout_choices_the_config_makes(tmp_path):
    f = tmp_path / "hw.toml"
    write_profile(f)
    cfg = Config()
    cfg.parallel.auto, cfg.train.hardware, cfg.parallel.tp = True, str(f), 2
    free = choose_layout(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=1)), 4)
    assert {e.layout.tp for e in free.ranked} > {2}  # left free, other tp sizes compete
    choice = choose_layout(cfg, 4)
    assert choice.ranked and {e.layout.tp for e in choice.ranked} == {2}
    assert "kept from the config: tp=2" in choice.explain()
    cfg.parallel.zero_stage = 1
    assert {(e.layout.tp, e.layout.zero_stage) for e in choose_layout(cfg, 4).ranked} == {(2, 1)}
    cfg.parallel.tp = 3
    with pytest.raises(ConfigError, match=r"tp=3 = 3 ranks\), but 3 does not divide the world size 4"):
        choose_layout(cfg, 4)


def test_auto_recomputes_only_when_nothing_else_fits():
    """Left at 'none', recompute is the planner's choice: off while a layout fits without it,
    on (and said so) when memory is too small for any layout without it; set, it is kept."""
    cfg = Config()
    cfg.parallel.auto = True
    roomy = choose_layout(cfg, 1, spec=(CPU_CORE, "test"))
    assert {e.layout.recompute for e in roomy.ranked} == {"none"}
    # below the smallest memory any no-recompute layout needs (at any micro-batch), above full's
    smallest = min(e.memory.total for e in roomy.ranked)
    tight = dataclasses.replace(CPU_CORE, hbm_bytes=smallest - 1)
    choice = choose_layout(cfg, 1, spec=(tight, "test"))
    assert choice.best.layout.recompute != "none" and choice.best.memory.total < smallest
    assert apply_layout(cfg, choice.best.layout).parallel.recompute == choice.best.layout.recompute
    cfg.parallel.recompute = "full"
    kept = choose_layout(cfg, 1, spec=(CPU_CORE, "test"))
    assert {e.layout.recompute for e in kept.ranked} == {"full"} and "recompute=full" in kept.explain()


def test_auto_without_a_profile_uses_the_cpu_spec(monkeypatch, tmp_path):
    monkeypatch.setenv("HYBRIDPAR_CACHE", str(tmp_path))  # no default profile there
    choice = choose_layout(Config(), 2)
    assert choice.hardware == CPU_CORE.name and "calibrate" in choice.source


def test_auto_with_no_runnable_layout_says_why():
    cfg = Config()  # 5 ranks: 3 sequences, 8 heads, 4 layers and 128 tokens split no way into 5
    cfg.train.global_batch, cfg.train.micro_batch, cfg.model.n_layers = 3, 3, 4
    with pytest.raises(ConfigError, match="parallel.auto found no layout .* on 5 process"):
        choose_layout(cfg, 5, spec=(CPU_CORE, "test"))


def test_train_auto_cli_one_process(tmp_path, capsys, monkeypatch):
    from hybridpar.cli import main

    f = tmp_path / "hw.toml"
    write_profile(f)
    run = tmp_path / "run"
    rc = main(["train", "--parallel.auto", "true", "--nproc", "1", "--train.hardware", str(f),
               "--train.steps", "1", "--train.eval_every", "0", "--train.sample_tokens", "0",
               "--train.run_dir", str(run), "--train.global_batch", "4", "--train.micro_batch", "4",
               "--train.seq_len", "32"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "parallel.auto: 1 processes on test cpu" in out and "chose dp=1,tp=1,pp=1,cp=1" in out
    assert (run / "metrics.jsonl").exists()


def test_auto_gives_its_reason_and_takes_zero3_only_for_memory():
    """The default 1.6M-parameter model: ZeRO-3 is not needed for memory, so it is not chosen
    (its gathers made the predictions run far ahead of the measured step), and the choice says why."""
    cfg = Config()
    cfg.parallel.auto = True
    for world in (2, 4):
        choice = choose_layout(cfg, world, spec=(CPU_CORE, "test"))
        assert all(e.layout.zero_stage < 3 for e in choice.ranked)
        text = choice.explain()
        assert "hybridpar: why: the fastest predicted of" in text and "ZeRO-3 layouts were left out" in text
        assert "ruled out" in text and "ZeRO-3 where a layout without it fits" in text
    cfg.parallel.zero_stage = 3  # kept when the config asks for it
    choice = choose_layout(cfg, 2, spec=(CPU_CORE, "test"))
    assert choice.best.layout.zero_stage == 3 and "ZeRO-3 kept from the config" in choice.explain()
