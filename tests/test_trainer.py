"""The single-process trainer, its schedule and data, and data parallel matching one process."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from layouts import SMALL, make_trainer, trainer_for

from hybridpar.config import Config, load_config
from hybridpar.data.corpus import WindowSampler, decode_bytes, encode_bytes
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.training.optim import lr_at
from hybridpar.training.trainer import Trainer


def small_config(tmp_path, *extra: str) -> Config:
    return load_config(None, [*SMALL, "--train.run_dir", str(tmp_path / "run"), *extra])


def test_lr_schedule_warmup_then_cosine():
    t = Config().train
    t.steps, t.warmup_steps, t.lr, t.min_lr = 100, 10, 1.0, 0.1
    assert lr_at(1, t) == pytest.approx(0.1)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(55, t) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(100, t) == pytest.approx(0.1)
    assert all(lr_at(s, t) >= lr_at(s + 1, t) for s in range(10, 100))


def test_sampler_is_a_pure_function_of_sample_id():
    tokens = np.arange(1000, dtype=np.uint8)
    a, b = WindowSampler(tokens, 16, seed=3), WindowSampler(tokens, 16, seed=3)
    x1, y1 = a.batch(range(0, 8))
    _ = a.batch(range(500, 508))  # moves a to another epoch and back
    x2, y2 = a.batch(range(0, 8))
    x3, _ = b.batch([*range(0, 4), *range(4, 8)])
    assert torch.equal(x1, x2) and torch.equal(y1, y2) and torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    # one epoch visits every window exactly once
    starts = sorted(int(a.batch([i])[0][0, 0]) for i in range(a.windows))
    assert starts == [(w * 16) % 256 for w in range(a.windows)] or len(set(starts)) <= 256


def test_byte_codec_roundtrip():
    text = "def f(x):\n    return 'héllo'\n"
    assert decode_bytes(encode_bytes(text).tolist()) == text


def test_fit_trains_and_writes_the_run_directory(tmp_path):
    cfg = small_config(tmp_path, "--train.steps", "12", "--train.log_every", "5", "--train.eval_every", "6",
                       "--train.lr", "1e-2")
    summary = make_trainer(cfg).fit()
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 5, 6, 10, 12]
    for r in records:
        assert {"step", "loss", "lr", "tokens_per_s", "mfu", "mem_bytes"} <= r.keys()
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["mem_bytes"] > 0
    assert "val_loss" in records[2] and "val_loss" in records[4]
    assert records[-1]["loss"] < records[0]["loss"] - 0.5  # byte-level loss falls fast from ln(256)
    assert math.isclose(records[0]["loss"], math.log(256), rel_tol=0.05)  # small init: near uniform
    assert summary["final_loss"] == records[-1]["loss"]
    assert (run / "loss.png").stat().st_size > 1000
    assert (run / "sample.txt").read_text().startswith("def ")
    assert any((run / "tensorboard").iterdir())
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 12


def test_previous_run_is_kept_not_overwritten(tmp_path):
    cfg = small_config(tmp_path, "--train.steps", "1", "--train.eval_every", "0")
    topo = ParallelDims.from_config(cfg.parallel).build("cpu")
    Trainer(cfg, topo).fit()
    Trainer(cfg, topo).fit()
    assert (tmp_path / "run.1" / "metrics.jsonl").exists()
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_grad_accumulation_equals_one_big_batch(tmp_path):
    """micro_batch 2 x 4 accumulation == micro_batch 8 in one pass (same global sample ids)."""
    runs = {}
    for micro in ("2", "8"):
        cfg = small_config(tmp_path, "--train.micro_batch", micro)
        trainer = make_trainer(cfg)
        losses = [trainer.train_step(s).loss for s in range(1, 4)]
        runs[micro] = (losses, {k: v.clone() for k, v in trainer.model.state_dict().items()})
    assert runs["2"][0] == pytest.approx(runs["8"][0], rel=1e-5)
    for k, v in runs["2"][1].items():
        torch.testing.assert_close(v, runs["8"][1][k], rtol=1e-5, atol=1e-6)


def test_bf16_autocast_trains(tmp_path):
    cfg = small_config(tmp_path, "--train.precision", "bf16", "--train.lr", "1e-2")
    trainer = make_trainer(cfg)
    losses = [trainer.train_step(s).loss for s in range(1, 9)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights


def test_clipping_bounds_the_update(tmp_path):
    cfg = small_config(tmp_path, "--train.grad_clip", "0.01")
    trainer = make_trainer(cfg)
    trainer.optimizer.step = lambda: None  # look at the clipped gradients only
    result = trainer.train_step(1)
    clipped = torch.stack([p.grad.pow(2).sum() for p in trainer.params]).sum().sqrt()
    assert result.grad_norm > 0.01
    assert float(clipped) == pytest.approx(0.01, rel=1e-3)


def _train_worker(rank: int, world: int, tmp: str, steps: int, extra: list[str]) -> dict:
    cfg = load_config(None, [*SMALL, "--train.run_dir", tmp, "--parallel.dp", str(world), *extra])
    with trainer_for(cfg) as trainer:
        topo = trainer.topo
        losses = [trainer.train_step(s).loss for s in range(1, steps + 1)]
        val = trainer.evaluate()
        return {"losses": losses, "val": val, "state": trainer.model.state_dict(),
                "buckets": len(trainer.engine.reducer.buckets),
                "traffic": topo.comm.counter.snapshot()}


@pytest.mark.parametrize("world, bucket_mb", [(2, 25.0), (4, 0.01)])
def test_data_parallel_matches_one_process(tmp_path, dist_run, world, bucket_mb):
    """Same global sample ids, so dp=N reproduces dp=1 losses and weights; tolerance 1e-5
    relative (fp32; only the summation order of the gradient average differs)."""
    steps = 3
    extra = ["--parallel.bucket_mb", str(bucket_mb)]
    ref = _train_worker(0, 1, str(tmp_path), steps, extra)
    results = dist_run(world, _train_worker, str(tmp_path), steps, extra)
    n_params = sum(v.numel() for v in ref["state"].values())
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert r["val"] == pytest.approx(ref["val"], rel=1e-5)
        for k, v in r["state"].items():
            torch.testing.assert_close(v, ref["state"][k], rtol=1e-5, atol=1e-6)
        # per step: every parameter's fp32 gradient once (in buckets) and one scalar for the
        # logged loss; plus one scalar for the validation loss
        buckets = r["buckets"]
        assert (buckets > 1) == (bucket_mb < 1)
        dp = r["traffic"]["all_reduce/dp"]
        assert dp["calls"] == steps * (buckets + 1) + 1
        assert dp["bytes"] == steps * 4 * (n_params + 1) + 4


def _overlap_worker(rank: int, world: int, tmp: str) -> tuple[int, int]:
    cfg = load_config(None, [*SMALL, "--train.run_dir", tmp, "--parallel.dp", str(world),
                             "--parallel.bucket_mb", "0.01"])
    with trainer_for(cfg) as trainer:
        topo = trainer.topo
        x, y = trainer.micro_batches(1, cfg.train.global_batch, trainer.train_data)[0]
        with trainer.engine.no_sync():
            trainer.engine.loss(x, y).backward()
        during_no_sync = topo.comm.counter.calls()
        trainer.engine.loss(x, y).backward()
        during_backward = topo.comm.counter.calls()  # before finish(): started by the hooks
        trainer.optimizer.finish_grads()
        return during_no_sync, during_backward


def test_buckets_reduce_during_backward_and_not_under_no_sync(tmp_path, dist_run):
    for no_sync_calls, backward_calls in dist_run(2, _overlap_worker, str(tmp_path)):
        assert no_sync_calls == 0
        assert backward_calls > 1  # several buckets already in flight when backward returns


def _fit_pp2(rank: int, world: int, tmp: str) -> dict:
    cfg = load_config(None, [*SMALL, "--train.run_dir", tmp, "--train.steps", "2", "--train.eval_every", "0",
                             "--parallel.pp", "2"])
    with trainer_for(cfg) as trainer:
        return trainer.fit()


def test_run_summary_reports_traffic_memory_and_timeline(tmp_path, dist_run):
    """The end-of-run summary: per-axis bytes of one step (pp: rank 0 sends each micro-batch's
    activation [2, 32, 32] fp32 forward, plus two scalar all-reduces), memory of every rank, the
    recorded pipeline timeline."""
    summary = dist_run(2, _fit_pp2, str(tmp_path / "run"))[0]
    microbatches, activation = 8 // 2, 2 * 32 * 32 * 4
    pp_bytes = summary["traffic_bytes_per_step"]["pp"]
    assert microbatches * activation <= pp_bytes <= microbatches * activation + 64
    assert len(summary["peak_memory_bytes_per_rank"]) == 2 and min(summary["peak_memory_bytes_per_rank"]) > 0
    assert (tmp_path / "run" / "pipeline_timeline.png").stat().st_size > 1000
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["traffic_bytes_per_step"] == {"pp": pp_bytes}
