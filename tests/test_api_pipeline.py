"""``PipelineModule`` on a user's list of layers: pp2 with every schedule (and dp2 x pp2 with a
ZeRO-2 optimizer) trains to the single-process losses and weights (fp32, rtol 1e-5)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar
from hybridpar.distributed.mesh import ParallelDims

STEPS, M, GLOBAL, D_IN, HID, D_OUT = 2, 4, 8, 8, 16, 4
OPT = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.0}
CLIP = 0.1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(HID, HID)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


def make_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(D_IN, HID), Block(), Block(), Block(), Block(), nn.Linear(HID, D_OUT)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL, D_IN, generator=gen), torch.randn(GLOBAL, D_OUT, generator=gen)


@functools.cache
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = nn.Sequential(*make_layers())
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad()
        step_losses = []
        for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True):
            loss = F.mse_loss(model(xm), ym)
            (loss / M).backward()
            step_losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(sum(step_losses) / M)
    return losses, {f"layers.{k}": v.clone() for k, v in model.state_dict().items()}


def _run(rank: int, world: int, pp: int, schedule: str, v: int, balance: str, stage: int) -> tuple:
    dp = world // pp
    with ParallelDims(dp=dp, pp=pp).build() as topo:
        mb = GLOBAL // M // dp
        pipe = hybridpar.PipelineModule(layers=make_layers(), topo=topo, num_microbatches=M, loss_fn=F.mse_loss,
                                        activation_shape=(mb, HID), schedule=schedule, virtual_stages=v,
                                        balance=balance)
        opt = hybridpar.ZeroOptimizer(list(pipe.named_parameters()), topo.dp, stage=stage, **OPT)
        losses = []
        for step in range(STEPS):
            x, y = batch(step)
            # micro-batch i of the global batch is split between the dp ranks
            mbs = [(xm.chunk(dp)[topo.dp.rank], ym.chunk(dp)[topo.dp.rank])
                   for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True)]
            loss = pipe.train_step(mbs, opt, max_norm=CLIP)
            losses.append(float(topo.comm.all_reduce(torch.tensor([loss]), topo.dp)) / dp)
        return losses, {k: v.detach().clone() for k, v in pipe.state_dict().items()}


def _check(results: list) -> None:
    ref_losses, ref_state = reference()
    merged: dict[str, torch.Tensor] = {}
    for losses, state in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
        merged.update(state)
    assert merged.keys() == ref_state.keys()
    for k in ref_state:
        torch.testing.assert_close(merged[k], ref_state[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("schedule, v, balance", [("gpipe", 1, "layers"), ("1f1b", 1, "params"),
                                                 ("zb-h1", 1, "layers"), ("interleaved", 2, "layers")])
def test_pp2_matches_single_process(dist_run, schedule, v, balance):
    _check(dist_run(2, _run, 2, schedule, v, balance, 0))


@pytest.mark.parametrize("schedule, stage", [("1f1b", 2), ("zb-h1", 1)])
def test_dp2_pp2_zero_matches_single_process(dist_run, schedule, stage):
    # zb-h1's separate weight-gradient pass must reach ZeRO's gradient hooks (it once did not)
    _check(dist_run(4, _run, 2, schedule, 1, "layers", stage))


def _first_loss(rank: int, world: int) -> float:
    """dp2 x pp2: what train_step returns for the first step on this rank."""
    with ParallelDims(dp=2, pp=2).build() as topo:
        pipe = hybridpar.PipelineModule(layers=make_layers(), topo=topo, num_microbatches=M, loss_fn=F.mse_loss,
                                        activation_shape=(GLOBAL // M // 2, HID))
        opt = hybridpar.ZeroOptimizer(list(pipe.named_parameters()), topo.dp, stage=1, **OPT)
        x, y = batch(0)
        mbs = [(xm.chunk(2)[topo.dp.rank], ym.chunk(2)[topo.dp.rank])
               for xm, ym in zip(x.chunk(M), y.chunk(M), strict=True)]
        return pipe.train_step(mbs, opt, max_norm=CLIP)


def test_train_step_returns_the_global_mean_loss(dist_run):
    """Every rank gets the loss of the whole step (both dp ranks' halves), as one process computes
    it, not its own dp rank's half (what it returned before)."""
    got = dist_run(4, _first_loss)
    assert got == pytest.approx([reference()[0][0]] * 4, rel=1e-5)


def test_single_process_pipeline_module():
    _check([_run(0, 1, 1, "1f1b", 1, "layers", 0)])


def test_arguments_are_checked():
    with ParallelDims().build() as topo:
        kw = dict(topo=topo, num_microbatches=2, loss_fn=F.mse_loss, activation_shape=(2, HID))
        with pytest.raises(ValueError, match="exactly one of"):
            hybridpar.PipelineModule(**kw)
        with pytest.raises(ValueError, match="give exactly 1"):
            hybridpar.PipelineModule(stages=make_layers()[:2], **kw)
        pipe = hybridpar.PipelineModule(stages=[nn.Sequential(*make_layers())], **kw)
        with pytest.raises(ValueError, match="3 micro-batches given"):
            pipe.train_step([batch(0)] * 3)
        with pytest.raises(RuntimeError, match="train_step"):
            pipe(torch.zeros(1))


def test_gradient_is_that_of_the_mean_loss():
    """forward_backward leaves in ``.grad`` the gradient of the mean micro-batch loss, as one
    process computes it (the optimizer tests above cannot see a wrong scale: Adam after clipping
    is scale-invariant)."""
    model = nn.Sequential(*make_layers())
    x, y = batch(0)
    mbs = list(zip(x.chunk(M), y.chunk(M), strict=True))
    torch.stack([F.mse_loss(model(xm), ym) for xm, ym in mbs]).mean().backward()
    with ParallelDims().build() as topo:
        pipe = hybridpar.PipelineModule(layers=make_layers(), topo=topo, num_microbatches=M, loss_fn=F.mse_loss,
                                        activation_shape=(GLOBAL // M, HID))
        pipe.forward_backward(mbs)
        ref = {f"layers.{k}": p.grad for k, p in model.named_parameters()}
        for name, p in pipe.named_parameters():
            torch.testing.assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-7, msg=name)
