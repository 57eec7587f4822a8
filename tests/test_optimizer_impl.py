"""Which kernel runs the optimizer update (``train.optimizer_impl``, ``optimizer_impl=``), and
what the fused kernel keeps exact.

By default every ZeRO stage, the expert split and the host copy of offload step with torch's
fused kernel where the device and dtype have one (CPU and CUDA floats); ``foreach`` and
``for-loop`` choose torch's other two. The exactness the layout tests rely on is derived in
``numerics.py`` ("The fused AdamW kernel"): at the first step from fresh state a shard's fused
update is bit for bit the whole tensor's, under every ``ATEN_CPU_CAPABILITY``.
"""

from __future__ import annotations

import pytest
import torch
from numerics import ADAMW_STEP_ULPS, assert_close_ulps
from test_planner_moe import MOE
from test_trainer import SMALL
from torch import nn

from hybridpar.config import ConfigError, load_config
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.parallel.zero import ExpertSplitOptimizer, ZeroOptimizer, decay_groups, shard_model

pytestmark = pytest.mark.numerics  # bitwise claims: also run under other ATEN_CPU_CAPABILITY (Makefile)

OPT = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def _model() -> nn.Sequential:
    """Shapes whose dp=2 shards start and end off the kernels' vector boundaries (8 and 16 floats)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 37), nn.Tanh(), nn.Linear(37, 5))


def _build(topo, stage: int, **options) -> tuple[nn.Module, ZeroOptimizer]:
    model = _model()
    sharded = shard_model(model, topo.dp, [model[0], model[2]]) if stage == 3 else None
    return model, ZeroOptimizer(decay_groups(model, 0.1), topo.dp, stage=stage, sharded=sharded, **options, **OPT)


def _kernels_worker(rank: int, world: int) -> dict[str, list[tuple[bool, str]]]:
    """Per optimizer: (the inner torch optimizer's ``defaults['fused']``, its kernel) of each part."""
    out: dict[str, list[tuple[bool, str]]] = {}
    with ParallelDims(dp=world).build("cpu") as topo:
        for stage in (0, 1, 2, 3):
            opt = _build(topo, stage)[1]
            out[f"zero{stage}"] = [(opt.inner.defaults["fused"], opt.kernel)]
        opt = _build(topo, 2, offload=True)[1]  # the update on the host copy
        out["offload"] = [(opt.inner.defaults["fused"], opt.kernel)]
        model = _model()
        dense, experts = list(model[0].named_parameters(prefix="0")), list(model[2].named_parameters(prefix="2"))
        split = ExpertSplitOptimizer(ZeroOptimizer(dense, topo.dp, stage=1, **OPT),
                                     ZeroOptimizer(experts, topo.dp, stage=2, **OPT), topo.ep)
        out["expert-split"] = [(p.inner.defaults["fused"], p.kernel) for p in split.parts]
    return out


def test_default_is_fused_at_every_stage_and_under_expert_split(dist_run):
    for name, parts in dist_run(2, _kernels_worker)[0].items():
        assert parts and all(fused is True and kernel == "fused" for fused, kernel in parts), (name, parts)


def _trainer_kernels(rank: int, world: int, tmp: str, stage: int) -> list[bool]:
    from hybridpar.training.engine import Engine

    cfg = load_config(None, [*SMALL, *MOE, "--train.run_dir", tmp, "--parallel.dp", "2", "--parallel.ep", "2",
                             "--parallel.zero_stage", str(stage)])
    with ParallelDims.from_config(cfg.parallel).build("cpu") as topo:
        opt = Engine(cfg, topo, torch.device("cpu")).optimizer
        assert isinstance(opt, ExpertSplitOptimizer)
        return [p.inner.defaults["fused"] for p in opt.parts]


@pytest.mark.parametrize("stage", [1, 3])
def test_trainer_default_is_fused_under_expert_parallelism(dist_run, tmp_path, stage):
    """The CLI trainer's optimizer: dense parameters over dp, experts over edp, both fused."""
    for fused in dist_run(2, _trainer_kernels, str(tmp_path), stage):
        assert fused == [True, True]


@pytest.mark.parametrize("stage, offload", [(0, False), (1, True)])
@pytest.mark.parametrize("impl, fused, foreach, kernel", [("foreach", None, True, "foreach"),
                                                          ("for-loop", None, False, "for-loop"),
                                                          ("fused", True, None, "fused")])
def test_each_impl_is_selected(stage, offload, impl, fused, foreach, kernel):
    topo = ParallelDims().build("cpu")
    opt = _build(topo, stage, offload=offload, optimizer_impl=impl)[1]
    assert (opt.inner.defaults["fused"], opt.inner.defaults["foreach"], opt.kernel) == (fused, foreach, kernel)


def test_bad_impl_is_refused_with_the_fix(tmp_path):
    topo = ParallelDims().build("cpu")
    with pytest.raises(ValueError, match="optimizer_impl = 'fast' is not an optimizer implementation; use 'auto'"):
        _build(topo, 0, optimizer_impl="fast")
    with pytest.raises(ValueError, match="RMSprop has no fused kernel; use 'auto', 'foreach' or 'for-loop'"):
        _build(topo, 0, optimizer_impl="fused", optimizer_cls=torch.optim.RMSprop)
    with pytest.raises(ValueError, match="both choose its kernel"):
        _build(topo, 0, optimizer_impl="foreach", fused=True)
    with pytest.raises(ConfigError, match="train.optimizer_impl = 'fast' is not an optimizer implementation"):
        load_config(None, [*SMALL, "--train.run_dir", str(tmp_path), "--train.optimizer_impl", "fast"])


def test_auto_leaves_unfusable_tensors_to_torch():
    """An optimizer without a fused kernel, or tensors it cannot walk (a strided view: the CPU
    kernel would update the wrong elements), keep torch's default; what the caller asks wins."""
    topo = ParallelDims().build("cpu")
    rmsprop = ZeroOptimizer(_model().parameters(), topo.dp, stage=0, optimizer_cls=torch.optim.RMSprop, lr=1e-2)
    assert rmsprop.kernel == "for-loop"
    strided = nn.Parameter(torch.randn(6, 8)[:, ::2])
    assert ZeroOptimizer([strided], topo.dp, stage=0, **OPT).kernel == "for-loop"
    assert _build(topo, 0, foreach=True)[1].kernel == "foreach"


# ----------------------------------------------------------------------------- exactness


def _adamw(p: torch.Tensor, grads: torch.Tensor, steps: int, **kernel) -> torch.Tensor:
    q = nn.Parameter(p.clone())
    opt = torch.optim.AdamW([q], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kernel)
    for g in grads[:steps]:
        q.grad = g.clone()
        opt.step()
    return q.detach()


@pytest.mark.parametrize("n", [5, 16, 17, 100, 1001])
def test_fused_shard_update_is_the_whole_tensors(n):
    """A piece of a tensor stepped on its own against the same elements of the whole tensor's
    step, with the fused kernel on both sides (numerics.py): bit for bit at step 1 for every
    cut; later steps within one step's ADAMW_STEP_ULPS of (|w| + lr) per step taken."""
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    grads = torch.randn(3, n, generator=gen) * torch.rand(n, generator=gen) ** 4  # widely spread magnitudes
    for steps in (1, 3):
        whole = _adamw(p, grads, steps, fused=True)
        for a, b in {(0, n // 3), (n // 3, n), (1, n), (0, n - 1), (n - 1, n), (3, max(3, n - 5))}:
            if a >= b:
                continue
            piece = _adamw(p[a:b], grads[:, a:b], steps, fused=True)
            if steps == 1:
                assert torch.equal(piece, whole[a:b]), (n, a, b)
            else:
                assert_close_ulps(piece, whole[a:b], steps * ADAMW_STEP_ULPS, floor=1e-3, msg=(n, a, b))


def _first_step_worker(rank: int, world: int, stage: int) -> dict[str, torch.Tensor]:
    with ParallelDims(dp=world).build("cpu") as topo:
        model, opt = _build(topo, stage)
        opt.zero_grad()
        gen = torch.Generator().manual_seed(rank)
        model(torch.randn(6, 13, generator=gen)).square().mean().backward()
        opt.finish_grads()
        opt.step()  # no clipping: the norm's order of summation is not at stake
        full = opt.gather_full_state_dict()
        return full if full is not None else {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_first_fused_step_of_every_stage_is_plain_data_parallel_bit_for_bit(dist_run, stage):
    """dp=2: the reduced gradient is plain dp's bit for bit (a + b == b + a), and the fused
    kernel's first step on a shard is the whole tensor's (numerics.py), so the weights are equal."""
    plain = dist_run(2, _first_step_worker, 0)[0]
    for r in dist_run(2, _first_step_worker, stage):
        assert plain.keys() == r.keys()
        for k, v in r.items():
            assert torch.equal(v, plain[k]), k
