"""The one data-parallel spec (:mod:`hybridpar.parallel.zero.spec`): built once from a config,
frozen, the same from the trainer's settings and from ``initialize``'s; ZeRO-3 built by it in one
call (2 gloo ranks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from hybridpar.api.engine import EngineConfig
from hybridpar.config import load_config
from hybridpar.distributed.mesh import ParallelDims
from hybridpar.parallel.zero import ZeroOptimizer, decay_groups, shard_model
from hybridpar.parallel.zero.spec import DataParallelSpec, Zero3, data_parallel_spec


def test_the_spec_states_every_data_parallel_setting_of_the_config():
    cfg = load_config(None, ["--parallel.dp", "2", "--parallel.zero_stage", "2", "--parallel.bucket_mb", "0.5",
                             "--parallel.grad_compression", "bf16", "--parallel.offload_optimizer", "true",
                             "--train.lr", "0.01", "--train.beta2", "0.9", "--train.eps", "1e-6",
                             "--train.optimizer_impl", "foreach"])
    spec = data_parallel_spec(cfg)
    assert spec == DataParallelSpec(stage=2, bucket_bytes=2**19, reduce_dtype=torch.bfloat16, offload=True,
                                    optimizer_impl="foreach",
                                    hyper=(("lr", 0.01), ("betas", (0.9, 0.9)), ("eps", 1e-6)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.stage = 3  # type: ignore[misc]


def test_initialize_settings_give_the_trainers_spec():
    """``initialize``'s settings are the trainer's in another spelling: the same spec, plus its
    optimizer choice (SGD takes momentum, not betas)."""
    engine = EngineConfig(zero_stage=1, lr=0.02, grad_compression="fp16", data_parallel_size=2)
    trainer = load_config(None, ["--parallel.dp", "2", "--parallel.zero_stage", "1", "--train.lr", "0.02",
                                 "--parallel.grad_compression", "fp16", "--train.beta2", str(engine.betas[1])])
    assert engine.data_parallel_spec() == data_parallel_spec(trainer)
    sgd = EngineConfig(optimizer="sgd", momentum=0.5).data_parallel_spec()
    assert sgd.optimizer_cls is torch.optim.SGD and dict(sgd.hyper) == {"lr": sgd.hyper[0][1], "momentum": 0.5}


def _one_call_worker(rank: int, world: int) -> list[bool]:
    """ZeRO-3 by the spec in one call against the two phases by hand (shard, then the optimizer
    of the shards): the same shards after two steps; below stage 3 a Zero3 shards nothing."""
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

    spec = DataParallelSpec(stage=3, hyper=(("lr", 0.01),))
    with ParallelDims(dp=world).build("cpu") as topo:
        one = model()
        opt_one = spec.build(decay_groups(one, 0.1), topo.dp, zero3=Zero3(one, [one[0], one[2]], prefetch=False))
        two = model()
        sharded = shard_model(two, topo.dp, [two[0], two[2]], prefetch=False)
        opt_two = ZeroOptimizer(decay_groups(two, 0.1), topo.dp, stage=3, sharded=sharded, lr=0.01)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(2):
            x = torch.randn(4, 8, generator=gen)
            for m, opt in ((one, opt_one), (two, opt_two)):
                opt.zero_grad()
                m(x).square().mean().backward()
                opt.finish_grads()
                opt.step()
        same = [torch.equal(a, b) for a, b in zip(one.parameters(), two.parameters(), strict=True)]
        plain = model()
        DataParallelSpec(stage=1).build(decay_groups(plain, 0.1), topo.dp, zero3=Zero3(plain, [plain[0]]))
        same.append(plain[0].weight.shape == (16, 8))  # stage 1: whole parameters, not shards
        return same


def test_zero3_is_built_in_one_call(dist_run):
    assert all(all(r) for r in dist_run(2, _one_call_worker))
