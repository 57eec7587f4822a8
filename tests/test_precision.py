"""Mixed precision and the non-finite loss policy."""

from __future__ import annotations

import math

import pytest
import torch
from layouts import SMALL, make_trainer

from hybridpar.config import load_config
from hybridpar.training import checkpoint
from hybridpar.training.errors import NonFiniteLossError
from hybridpar.training.trainer import Trainer


def make(tmp_path, *extra: str, dp: int = 1) -> Trainer:
    cfg = load_config(None, [*SMALL, "--train.run_dir", str(tmp_path / "run"), "--train.eval_every", "0",
                             "--parallel.dp", str(dp), *extra])
    return make_trainer(cfg)


def snapshot(trainer: Trainer) -> tuple[dict, dict]:
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in trainer.optimizer.state_dict()["state"].items()}
    return weights, state


def assert_unchanged(before: tuple[dict, dict], trainer: Trainer) -> None:
    weights, state = snapshot(trainer)
    for k, v in before[0].items():
        assert torch.equal(weights[k], v), k
    assert state.keys() == before[1].keys()
    for i, s in before[1].items():
        for k, v in s.items():
            assert torch.equal(state[i][k], v), (i, k)


def test_fp16_trains_with_a_growing_scale(tmp_path):
    trainer = make(tmp_path, "--train.precision", "fp16", "--train.lr", "1e-2", "--train.loss_scale_init", "256",
                   "--train.loss_scale_window", "3")
    results = [trainer.train_step(s) for s in range(1, 10)]
    assert not any(r.skipped for r in results)
    assert results[-1].loss < results[0].loss and all(math.isfinite(r.loss) for r in results)
    assert trainer.scaler.scale == 256 * 2**3  # doubled after every 3 clean steps
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


def test_fp16_overflow_skips_the_step_and_halves_the_scale(tmp_path):
    trainer = make(tmp_path, "--train.precision", "fp16", "--train.loss_scale_init", str(2.0**40))
    before = snapshot(trainer)
    result = trainer.train_step(1)
    assert result.skipped and trainer.scaler.scale == 2.0**39
    assert_unchanged(before, trainer)  # no weight and no optimizer state (not even its step count)
    while trainer.train_step(2).skipped:  # the scale keeps halving until gradients fit fp16
        pass
    assert trainer.scaler.scale < 2.0**20


def _one_rank_overflows(rank: int, world: int, tmp: str, extra: list[str]) -> tuple[bool, bool, float, bool]:
    trainer = make(__import__("pathlib").Path(tmp), "--train.precision", "fp16", *extra, dp=world)
    if rank == 1:  # only this rank's gradient overflows (a hook on an activation: any ZeRO stage)
        trainer.model.norm.register_forward_hook(lambda _m, _i, out: out.register_hook(lambda g: g * float("inf"))
                                                 and None)
    before = trainer.engine.full_state_dict()
    result = trainer.train_step(1)
    after = trainer.engine.full_state_dict()
    unchanged = all(torch.equal(after[k], v) for k, v in before.items())
    residuals = trainer.optimizer.residuals().values()  # int8: the overflowed step's feedback is dropped
    clean = all(bool((r == 0).all()) for r in residuals)
    trainer.topo.close()
    return result.skipped, unchanged, trainer.scaler.scale, clean


@pytest.mark.parametrize("extra", [[], ["--parallel.zero_stage", "1"], ["--parallel.zero_stage", "2"],
                                   ["--parallel.zero_stage", "3"],
                                   ["--parallel.zero_stage", "2", "--parallel.grad_compression", "int8"],
                                   ["--parallel.grad_compression", "int8"]])
def test_one_ranks_overflow_skips_the_step_everywhere(tmp_path, dist_run, extra):
    """Under every ZeRO stage the overflow is seen in this rank's shard of the reduced gradient
    and the decision is taken by all ranks alike: no weight changes anywhere, the scale halves."""
    results = dist_run(2, _one_rank_overflows, str(tmp_path), extra)
    assert results == [(True, True, 2.0**15, True)] * 2


def _int8_residuals_after_step_1(rank: int, world: int, tmp: str, window: int) -> list[torch.Tensor]:
    trainer = make(__import__("pathlib").Path(tmp), "--train.precision", "fp16", "--train.loss_scale_init", "512",
                   "--train.loss_scale_window", str(window), "--parallel.grad_compression", "int8", dp=world)
    assert not trainer.train_step(1).skipped
    out = [r.clone() for r in trainer.optimizer.residuals().values()]
    assert trainer.scaler.scale == (1024 if window == 1 else 512)
    trainer.topo.close()
    return out


def test_int8_residuals_follow_the_loss_scale(tmp_path, dist_run):
    """The error feedback is in scaled-gradient units: when step 1 doubles the scale (window 1),
    the residual it carries is exactly twice the one a run keeping the scale carries."""
    kept = dist_run(2, _int8_residuals_after_step_1, str(tmp_path / "a"), 1000)
    doubled = dist_run(2, _int8_residuals_after_step_1, str(tmp_path / "b"), 1)
    for a, b in zip(kept, doubled, strict=True):
        assert a and any(bool(r.abs().max() > 0) for r in a)
        for x, y in zip(a, b, strict=True):
            assert torch.equal(y, 2 * x)


def nan_at(trainer: Trainer, steps: set[int]) -> None:
    real = trainer.engine.loss
    state = {"step": 0}

    def loss_fn(x, y):
        loss = real(x, y)
        return loss * float("nan") if state["step"] in steps else loss

    real_step = trainer.train_step

    def train_step(step):
        state["step"] = step
        return real_step(step)

    trainer.engine.loss = loss_fn
    trainer.train_step = train_step


def test_nan_loss_stops_naming_step_and_checkpoint(tmp_path):
    trainer = make(tmp_path, "--train.steps", "6", "--train.checkpoint_every", "2")
    nan_at(trainer, {3})
    with pytest.raises(NonFiniteLossError) as err:
        trainer.fit()
    msg = str(err.value)
    assert "loss is nan at step 3" in msg and "step-000002" in msg and "train.nonfinite" in msg


def test_nan_loss_skip_policy_skips_up_to_k_steps(tmp_path):
    trainer = make(tmp_path, "--train.steps", "6", "--train.nonfinite", "skip", "--train.max_skipped_steps", "1")
    nan_at(trainer, {2, 4})
    trainer.train_step(1)
    before = snapshot(trainer)
    assert trainer.train_step(2).skipped
    assert_unchanged(before, trainer)
    assert not trainer.train_step(3).skipped
    with pytest.raises(NonFiniteLossError, match="after 1 skipped steps"):
        trainer.train_step(4)


def test_loss_scale_survives_resume(tmp_path):
    trainer = make(tmp_path, "--train.precision", "fp16", "--train.steps", "4", "--train.loss_scale_init", "512",
                   "--train.loss_scale_window", "2")
    trainer.fit()
    again = make(tmp_path, "--train.precision", "fp16", "--train.steps", "6", "--train.loss_scale_init", "512",
                 "--train.loss_scale_window", "2")
    again.load_checkpoint(checkpoint.latest_checkpoint(tmp_path / "run"))
    assert again.scaler.scale == trainer.scaler.scale == 2048
