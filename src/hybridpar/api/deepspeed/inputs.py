"""What DeepSpeed's ``initialize`` is given, in the engine's terms: the parameter groups
(:func:`named_groups`) and the data loader (:func:`dataloader`), shared by the plain and the
pipeline front doors (:mod:`~hybridpar.api.deepspeed.front`, :mod:`~hybridpar.api.deepspeed.pipe`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

from hybridpar.api.deepspeed.config import DeepSpeedConfig
from hybridpar.config import ConfigError
from hybridpar.distributed.mesh import Topology

__all__ = ["GROUP_OPTIONS", "dataloader", "named_groups"]

GROUP_OPTIONS = ("lr", "weight_decay", "betas", "eps", "momentum", "name")


def named_groups(model: nn.Module, model_parameters: Any, weight_decay: float) -> list[dict[str, Any]]:
    """``model_parameters`` (None: the model's trainable ones) as named groups, DeepSpeed's way:
    groups as given, a plain iterable one group; ``weight_decay`` where a group has none."""
    names = {id(p): n for n, p in model.named_parameters()}
    items = list(model_parameters) if model_parameters is not None else \
        [p for p in model.parameters() if p.requires_grad]
    if not items:
        raise ConfigError("initialize(): model_parameters is empty; pass model.parameters() or parameter groups")
    groups = items if isinstance(items[0], Mapping) else [{"params": items}]
    out = []
    for g in groups:
        params = [g["params"]] if isinstance(g["params"], Tensor) else list(g["params"])
        named = []
        for x in params:
            p = x[1] if isinstance(x, tuple) else x
            if id(p) not in names:
                raise ConfigError(f"initialize(): model_parameters holds a tensor of shape {tuple(p.shape)} that is not "
                                  "a parameter of model; pass model.parameters() or groups of them")
            named.append((names[id(p)], p))
        extra = sorted(set(g) - {"params", *GROUP_OPTIONS})
        if extra:
            raise ConfigError(f"initialize(): parameter group options {extra} are not supported; a group may set "
                              f"{', '.join(GROUP_OPTIONS)}")
        out.append({**{k: v for k, v in g.items() if k != "params"}, "params": named,
                    "weight_decay": g.get("weight_decay", weight_decay)})
    return out


def dataloader(data: Any, ds: DeepSpeedConfig, topo: Topology, collate_fn: Callable[..., Any] | None) -> DataLoader:
    """DeepSpeed's loader: this dp rank's share (DistributedSampler, shuffled with seed 0) in
    micro-batches of ``train_micro_batch_size_per_gpu``."""
    sampler = DistributedSampler(data, num_replicas=topo.dp.size, rank=topo.dp.rank)
    return DataLoader(data, batch_size=ds.micro_batch, sampler=sampler, collate_fn=collate_fn)
