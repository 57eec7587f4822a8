"""ZeRO checkpoints through torch.distributed.checkpoint: exact resume at the same dp, resharding
to another dp size and stage, and compatibility with the plain-AdamW checkpoints the trainer
writes today (``get_state_dict`` layout), read through the allow-list ``SafeReader``."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_zero import OPT, STEPS, WD, build, full_state, make_model, reference, train

from hybridpar.distributed.mesh import ParallelDims
from hybridpar.training.checkpoint import SafeReader
from hybridpar.training.optim import clip_by_total_norm, grad_norm_sq

pytestmark = pytest.mark.numerics  # layout equality: also run under other ATEN_CPU_CAPABILITY (Makefile)


def _save_load_worker(rank: int, world: int, ckpt: str, save_stage: int, load_stage: int | None) -> dict:
    """Train step 1 at ``save_stage`` and save; then (at ``load_stage``) load into fresh state
    and train steps 2-3. Without ``load_stage`` only save and train on."""
    with ParallelDims(dp=world).build("cpu") as topo:
        out: dict = {}
        if save_stage is not None:
            model, opt, sharded = build(topo, save_stage)
            train(model, opt, topo, range(1, 2))
            dcp.save(opt.checkpoint_state(model), checkpoint_id=ckpt)
            out["cont"] = train(model, opt, topo, range(2, STEPS + 1))[0]
            out["cont_state"] = full_state(model, sharded)
        if load_stage is not None:
            model, opt, sharded = build(topo, load_stage)
            state = opt.checkpoint_state(model)
            dcp.load(state, storage_reader=SafeReader(ckpt))
            opt.load_checkpoint_state(model, state)
            out["resumed"] = train(model, opt, topo, range(2, STEPS + 1))[0]
            out["resumed_state"] = full_state(model, sharded)
        return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoint_roundtrip_same_dp(dist_run, tmp_path, stage):
    """Each rank writes its shard; resuming gives the same steps bit for bit."""
    for r in dist_run(2, _save_load_worker, str(tmp_path / "ckpt"), stage, stage):
        assert r["resumed"] == r["cont"]
        for k, v in r["resumed_state"].items():
            assert torch.equal(v, r["cont_state"][k]), k


def test_checkpoint_reshards_dp4_zero3_to_dp2_zero1(dist_run, tmp_path):
    """Saved at dp=4 ZeRO-3, resumed at dp=2 ZeRO-1: steps 2-3 still match one process."""
    ckpt = str(tmp_path / "ckpt")
    dist_run(4, _save_load_worker, ckpt, 3, None)
    ref = reference()
    for r in dist_run(2, _save_load_worker, ckpt, None, 1):
        assert r["resumed"] == pytest.approx(ref["losses"][1:], rel=1e-5)
        for k, v in r["resumed_state"].items():
            torch.testing.assert_close(v, ref["state"][k], rtol=1e-5, atol=1e-5)


class _PlainAdamW:
    """The current trainer's optimizer protocol on one process (torch AdamW, no ZeRO)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.opt = torch.optim.AdamW([
            {"params": [p for p in self.params if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0}], **OPT)
        self.param_groups = self.opt.param_groups

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish_grads(self) -> None:
        pass

    def grad_norm_sq(self) -> torch.Tensor:
        return grad_norm_sq(self.params)

    def clip(self, norm: torch.Tensor, max_norm: float) -> None:
        clip_by_total_norm(self.params, norm, max_norm)

    def step(self) -> None:
        self.opt.step()


def test_plain_adamw_checkpoint_resumes_under_zero2(dist_run, tmp_path):
    """A checkpoint in torch's ``get_state_dict`` layout (what checkpoint.py writes for plain
    AdamW) resumes at dp=2 ZeRO-2: the same keys, the optimizer state read as row shards."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ckpt = str(tmp_path / "plain")
    model = make_model()
    plain = _PlainAdamW(model)
    train(model, plain, ParallelDims().build("cpu"), range(1, 2))
    model_sd, optim_sd = get_state_dict(model, plain.opt)
    with warnings.catch_warnings():  # DCP notes that a one-process save is one-process
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt, no_dist=True)
    ref = reference()
    for r in dist_run(2, _save_load_worker, ckpt, None, 2):
        assert r["resumed"] == pytest.approx(ref["losses"][1:], rel=1e-5)
        for k, v in r["resumed_state"].items():
            torch.testing.assert_close(v, ref["state"][k], rtol=1e-5, atol=1e-5)
