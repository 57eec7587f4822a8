"""``hybridpar.initialize`` called as ``deepspeed.initialize``: the ds_config read
(:mod:`~hybridpar.api.deepspeed.config`), the parameter groups and optimizer DeepSpeed would
build, the data loader, and the engine; returns ``(engine, optimizer, dataloader, lr_scheduler)``.

Parameter groups as DeepSpeed means them: ``model_parameters`` given as groups are used as
given (a group without ``weight_decay`` takes the optimizer's), a plain iterable of parameters
(or none: the model's) is one group, decayed whole. A client ``optimizer=`` (an Adam, AdamW or SGD
instance, or a callable building one from the parameters) gives its class, hyperparameters and
groups; the engine's ZeRO optimizer then runs that class.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridpar.api.autotp import check_autotp
from hybridpar.api.deepspeed.config import load_ds_config, parse_ds_config
from hybridpar.api.deepspeed.engine import DeepSpeedEngine
from hybridpar.api.deepspeed.inputs import GROUP_OPTIONS, dataloader, named_groups
from hybridpar.api.deepspeed.pipe import pipeline_initialize
from hybridpar.api.engine import EngineConfig
from hybridpar.api.facade import backend_device_type
from hybridpar.api.pipeline import PipelineModule
from hybridpar.config import ConfigError
from hybridpar.distributed.mesh import ParallelDims, Topology, init_distributed

__all__ = ["add_config_arguments", "deepspeed_initialize", "named_groups"]

CLIENT_OPTIMIZERS = {torch.optim.AdamW: "adamw", torch.optim.Adam: "adam", torch.optim.SGD: "sgd"}
def _client_optimizer(optimizer: Any, model: nn.Module, model_parameters: Any) -> tuple[dict[str, Any], Any]:
    """A client optimizer (or a callable making one) as EngineConfig keys and its groups."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        params = model_parameters if model_parameters is not None else model.parameters()
        optimizer = optimizer(params)
    name = CLIENT_OPTIMIZERS.get(type(optimizer))
    if name is None:
        raise ConfigError(f"initialize(): optimizer={type(optimizer).__name__} is not supported; pass a torch.optim "
                          "Adam, AdamW or SGD (or an optimizer block in the ds_config)")
    d = optimizer.defaults
    if d.get("amsgrad") or d.get("nesterov") or d.get("maximize") or d.get("dampening"):
        raise ConfigError(f"initialize(): optimizer={type(optimizer).__name__} with amsgrad/nesterov/maximize/dampening "
                          "is not supported")
    keys: dict[str, Any] = {"optimizer": name, "lr": float(d["lr"]), "weight_decay": float(d.get("weight_decay", 0.0))}
    if name == "sgd":
        keys["momentum"] = float(d.get("momentum", 0.0))
    else:
        keys.update(betas=tuple(float(b) for b in d["betas"]), eps=float(d["eps"]))
    groups = [{**{k: g[k] for k in GROUP_OPTIONS if k in g}, "params": g["params"]} for g in optimizer.param_groups]
    return keys, groups


def _world(topo: Topology | None) -> int:
    if topo is not None:
        return topo.world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _hidden(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    return int(hidden) if isinstance(hidden, int) else None


def deepspeed_initialize(model: nn.Module, config: Any = None, *, topo: Topology | None = None, args: Any = None,
                         model_parameters: Any = None, optimizer: Any = None, training_data: Any = None,
                         lr_scheduler: Any = None, mpu: Any = None, collate_fn: Any = None,
                         config_params: Mapping[str, Any] | None = None) -> tuple[Any, Any, Any, Any]:
    """``deepspeed.initialize``'s arguments -> ``(engine, optimizer, dataloader, lr_scheduler)``
    (module doc). Every config check runs before a process group is created."""
    if mpu is not None:
        raise ConfigError("initialize(mpu=...) (Megatron's model-parallel unit) is not supported; give "
                          "tensor_parallel.autotp_size in the ds_config")
    if config is None and config_params is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if lr_scheduler is not None and (not callable(lr_scheduler) or isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler)):
        raise ConfigError("initialize(lr_scheduler=<scheduler object>) is not supported (the engine builds its own "
                          "optimizer); pass a callable optimizer -> scheduler, or a scheduler block in the ds_config")
    if isinstance(model, PipelineModule):
        return pipeline_initialize(model, load_ds_config(config, config_params), training_data, collate_fn)
    raw = load_ds_config(config, config_params)
    ds = parse_ds_config(raw, _world(topo), _hidden(model), client_optimizer=optimizer is not None)
    tp = ds.engine.tensor_parallel_size or 1
    if tp > 1:  # AutoTP's checks (plan, heads, tied vocab): before any group
        try:
            check_autotp(model, tp)
        except ValueError as e:
            raise ConfigError(f"ds_config: tensor_parallel.autotp_size = {tp}: {e}") from None
    groups: Any = None
    if optimizer is not None:
        keys, groups = _client_optimizer(optimizer, model, model_parameters)
        ds.engine = EngineConfig.from_dict({**_fields(ds.engine), **keys})
        ds.engine.validate()
    groups = named_groups(model, groups if groups is not None else model_parameters, ds.engine.weight_decay)
    owns = topo is None
    if topo is None:
        init_distributed()
        tp = ds.engine.tensor_parallel_size or 1
        topo = ParallelDims(dp=_world(None) // tp, tp=tp).build(backend_device_type(None))
    engine = DeepSpeedEngine(model, ds, topo, owns, groups, lr_scheduler)
    if ds.no_effect and topo.rank == 0:
        print(f"[hybridpar] ds_config keys accepted without effect here (docs/howto/deepspeed.md): {', '.join(ds.no_effect)}",
              flush=True)
    loader = None if training_data is None else dataloader(training_data, ds, topo, collate_fn)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _fields(cfg: EngineConfig) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's ``--deepspeed``, ``--deepspeed_config`` (and the old ``--deepscale`` /
    ``--deepscale_config``) on ``parser``, as DeepSpeed adds them; ``initialize(args=args)`` reads
    ``args.deepspeed_config``. Returns ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
