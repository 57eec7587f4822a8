"""The front door ``initialize``: an :class:`~hybridpar.api.engine.ModelEngine` from a model and
an :class:`~hybridpar.api.engine.EngineConfig`, or, called DeepSpeed's way, DeepSpeed's four-tuple
(:mod:`hybridpar.api.deepspeed`). It sits above both, so neither imports the other inside a
function (the ``api/`` contract in ``pyproject.toml``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from torch import nn

from hybridpar.api.autotp import check_autotp
from hybridpar.api.deepspeed import deepspeed_initialize
from hybridpar.api.deepspeed.schema import BLOCKS, KNOWN_UNSUPPORTED
from hybridpar.api.engine import EngineConfig, ModelEngine
from hybridpar.api.facade import backend_device_type
from hybridpar.distributed.mesh import ParallelDims, Topology, init_distributed

__all__ = ["initialize"]


def initialize(model: nn.Module | None = None, config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
               *, topo: Topology | None = None, args: Any = None, model_parameters: Any = None, optimizer: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Any = None, config_params: Mapping[str, Any] | None = None) -> Any:
    """Wrap ``model`` (initialised identically on every rank) for data parallel / ZeRO training
    and, with ``tensor_parallel_plan``, tensor parallelism; returns a :class:`ModelEngine`.

    ``topo`` (e.g. from :func:`~hybridpar.initialize_parallelism`) gives the layout; without it
    the engine initializes ``torch.distributed`` from the torchrun environment and builds a
    dp x tp topology from ``data_parallel_size`` / ``tensor_parallel_size``.

    Called DeepSpeed's way (any of ``config_params``, ``model_parameters``, ``optimizer``,
    ``training_data``, ``lr_scheduler``, ``args``, ``mpu``, a ds_config file path, or a dict with
    DeepSpeed's keys), it returns ``(engine, optimizer, dataloader, lr_scheduler)`` as
    ``deepspeed.initialize`` does (:mod:`hybridpar.api.deepspeed`; docs/howto/deepspeed.md).
    ``dist_init_required`` is accepted and has no effect (the process group is created when needed)."""
    if model is None:
        raise ValueError("initialize() needs a model (model=...)")
    if _deepspeed_call(config, args, model_parameters, optimizer, training_data, lr_scheduler, mpu, config_params):
        return deepspeed_initialize(model, config, topo=topo, args=args, model_parameters=model_parameters,
                                    optimizer=optimizer, training_data=training_data, lr_scheduler=lr_scheduler,
                                    mpu=mpu, collate_fn=collate_fn, config_params=config_params)
    cfg = config if isinstance(config, EngineConfig) else EngineConfig.from_dict(config or {})  # type: ignore[arg-type]
    if (cfg.tensor_parallel_size or 1) > 1 and not cfg.tensor_parallel_plan:  # AutoTP: refused before any group
        check_autotp(model, cfg.tensor_parallel_size)
    owns = topo is None
    if topo is None:
        _, world = init_distributed()
        tp = cfg.tensor_parallel_size or 1
        dp = cfg.data_parallel_size if cfg.data_parallel_size is not None else max(1, world // tp)
        if dp * tp != world:
            raise ValueError(f"data_parallel_size * tensor_parallel_size = {dp} * {tp} = {dp * tp} but "
                             f"{world} processes are running; launch {dp * tp} or change the sizes")
        topo = ParallelDims(dp=dp, tp=tp).build(backend_device_type(None))
    elif cfg.data_parallel_size not in (None, topo.dp.size):
        raise ValueError(f"data_parallel_size = {cfg.data_parallel_size} but the topology has dp = {topo.dp.size}")
    return ModelEngine(model, cfg, topo, owns_topology=owns)


def _deepspeed_call(config: Any, *deepspeed_only: Any) -> bool:
    """Whether ``initialize`` was called DeepSpeed's way: a DeepSpeed-only argument given, a
    config file path, or a dict with a DeepSpeed key that no :class:`EngineConfig` field shares."""
    if any(a is not None for a in deepspeed_only) or isinstance(config, str | os.PathLike):
        return True
    if not isinstance(config, Mapping):
        return False
    ours = {f.name for f in dataclasses.fields(EngineConfig)}
    return any(k not in ours and (k in BLOCKS[""] or k in KNOWN_UNSUPPORTED) for k in config)
