"""The one data-parallel spec (:mod:`hybridpar.parallel.zero.spec`): built once from a config,
frozen, the same from the trainer's settings and from ``initialize``'s. Pure logic, no process group."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridpar.api.engine import EngineConfig
from hybridpar.config import load_config
from hybridpar.parallel.zero.spec import DataParallelSpec, data_parallel_spec


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
