"""ZeRO-3 with tied and shared parameters: a Hugging Face GPT-2 whose head is tied to the
embedding (one parameter registered on two modules) trains at dp2 ZeRO-3 through
``hybridpar.initialize`` as one plain PyTorch process does, its checkpoints load at ZeRO-1 / dp1
and back; the CLI families' tied embeddings at ZeRO-3 dp2 train as one process."""

from __future__ import annotations

import functools

import pytest
import torch
from layouts import LR as LAYOUT_LR
from layouts import STEPS as LAYOUT_STEPS
from layouts import Run, assert_trains_like, assert_weights_close, reference, train_layout
from numerics import LOSS_RTOL, adam_noise_cap, layout_weight_atol
from torch import nn

import hybridpar
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.parallel.zero import shard_model

pytestmark = pytest.mark.numerics  # layout equality: also run under other ATEN_CPU_CAPABILITY (Makefile)

transformers = pytest.importorskip("transformers")

STEPS, SAVE_AT, LR, BATCH, SEQ = 3, 2, 1e-3, 4, 16
CFG = {"lr": LR, "grad_clip": 1.0, "betas": (0.9, 0.95)}
TIED = ("lm_head.weight", "transformer.wte.weight")


def make_gpt2() -> nn.Module:
    """The issue's small GPT-2 (2 layers, n_embd 64, vocab 256), head tied to the embedding."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=SEQ,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    return model


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


@functools.cache
def plain_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch on the whole batch: AdamW over model.parameters() (the tied weight once),
    clip_grad_norm_."""
    model = make_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=CFG["betas"], weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(input_ids=batch(step), labels=batch(step)).loss
        loss.backward()
        losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(model.parameters(), CFG["grad_clip"])
        opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(engine: hybridpar.ModelEngine, steps: range, save: str | None = None) -> list[float]:
    dp = engine.topo.dp
    rows = slice(dp.rank * BATCH // dp.size, (dp.rank + 1) * BATCH // dp.size)
    losses = []
    for step in steps:
        x = batch(step)[rows]
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(engine.topo.comm.all_reduce(loss.detach().clone(), dp)) / dp.size)
        if save is not None and step + 1 == SAVE_AT:
            engine.save(save)
    return losses


def _run(rank: int, world: int, stage: int, save: str | None = None, resume: str | None = None) -> dict:
    """Train at dp ``world`` and ZeRO ``stage`` (from checkpoint ``resume``, saving at SAVE_AT to
    ``save``); the losses, the gathered weights and (ZeRO-3) where the tied weight went."""
    with ParallelDims(dp=world).build() as topo:
        engine = hybridpar.initialize(make_gpt2(), {**CFG, "zero_stage": stage}, topo=topo)
        start = 0
        if resume is not None:
            engine.load(resume)
            start = engine.global_step
        losses = _train(engine, range(start, STEPS), save)
        sharded = engine.optimizer.sharded
        units = [] if sharded is None else [(u.name, list(u.fqns), dict(u.aliases)) for u in sharded.units]
        return {"losses": losses, "state": engine.full_state_dict(), "units": units, "start": start}


def _check(result: dict) -> None:
    ref_losses, ref_state = plain_reference()
    assert result["losses"] == pytest.approx(ref_losses[result["start"]:], rel=LOSS_RTOL)
    state = result["state"]
    assert state.keys() == ref_state.keys()  # both names of the tied weight, as model.state_dict()
    assert torch.equal(state[TIED[0]], state[TIED[1]])
    for k in ref_state:
        assert_weights_close(k, state[k], ref_state[k], layout_weight_atol(LR, STEPS), adam_noise_cap(LR, STEPS))


def test_tied_gpt2_zero3_dp2_matches_one_process_and_checkpoints_reshard(dist_run, tmp_path):
    """dp2 ZeRO-3 against plain PyTorch; its step-2 checkpoint continued at dp1 ZeRO-1, and a
    dp1 ZeRO-1 checkpoint continued at dp2 ZeRO-3: the uninterrupted trajectory each time."""
    results = dist_run(2, _run, 3, str(tmp_path / "zero3"))
    for r in results:
        _check(r)
        # one parameter, in the root unit (gathered through the whole pass), under its first name;
        # its second name an alias of it, in no other unit
        root = r["units"][0]
        assert root == ("<root>", ["transformer.wte.weight"], {"lm_head.weight": "transformer.wte.weight"})
        assert all("transformer.wte.weight" not in fqns for _, fqns, _ in r["units"][1:])
    _check(_run(0, 1, 1, resume=str(tmp_path / "zero3")))
    _run(0, 1, 1, save=str(tmp_path / "zero1"))
    for r in dist_run(2, _run, 3, None, str(tmp_path / "zero1")):
        assert r["start"] == SAVE_AT
        _check(r)


class _Shared(nn.Module):
    """One weight registered on two Linear modules that two different units run."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _shared_grads(rank: int, world: int) -> dict[str, torch.Tensor]:
    model = _Shared()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    with ParallelDims(dp=world).build() as topo:
        sharded = shard_model(model, topo.dp, [model.a, model.b])
        model(x[rank * 4 // world:(rank + 1) * 4 // world]).square().sum().mul(world).backward()
        sharded.finish()
        unit = next(u for u in sharded.units if "a.weight" in u.fqns)
        grad = unit.grads.views()[unit.fqns.index("a.weight")]
        return {"unit": unit.name, "grad": grad.clone(), "rows": unit.layout.local_rows(unit.fqns.index("a.weight"))}


def test_parameter_shared_by_two_units_gets_the_summed_gradient(dist_run):
    """A weight used by two units lands in the root unit; its gradient is the sum of both uses
    (and the dp average), exactly as one process computes it."""
    model = _Shared()
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    model(x).square().sum().backward()
    for r in dist_run(2, _shared_grads):
        assert r["unit"] == "<root>"
        lo, hi = r["rows"]
        torch.testing.assert_close(r["grad"], model.a.weight.grad[lo:hi], rtol=1e-6, atol=1e-6)


TIED_FLAGS = ("--model.tie_embeddings", "true")
ZERO3 = ("--parallel.dp", "2", "--parallel.zero_stage", "3")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cli_family_tied_embeddings_at_zero3_dp2(family, tmp_path_factory):
    tmp = str(tmp_path_factory.getbasetemp() / f"tied-{family}")
    model = ("--model.family", family, *TIED_FLAGS, *(("--model.n_kv_heads", "4") if family == "gpt2" else ()))
    results = train_layout(Run(tmp, (*model, *ZERO3)))
    ref = reference(Run(tmp, model))
    assert "output.weight" not in ref.state
    assert_trains_like(results, ref, atol=layout_weight_atol(LAYOUT_LR, LAYOUT_STEPS), same_keys=True)
