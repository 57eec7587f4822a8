"""The options of a :class:`~hybridpar.parallel.zero.optimizer.ZeroOptimizer`: its parameter
groups (:func:`decay_groups`, :func:`normalize_groups`), the gradient compression names
(:data:`COMPRESSION_DTYPES`) and which combinations of stage, offload and compression exist
(:func:`check_options`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hybridpar.parallel.zero.stage import LOW_PRECISION, NamedParam
from hybridpar.parallel.zero.zero3 import ShardedModel

__all__ = ["COMPRESSION_DTYPES", "check_options", "decay_groups", "normalize_groups"]

# parallel.grad_compression (and the engine's grad_compression) -> ZeroOptimizer's reduce_dtype
COMPRESSION_DTYPES: dict[str, torch.dtype | None] = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16,
                                                     "int8": torch.int8}


def decay_groups(model: nn.Module | Iterable[NamedParam], weight_decay: float) -> list[dict[str, Any]]:
    """Named parameter groups of ``model`` (or of the named parameters given, e.g. one pipeline
    stage's): weight decay on matrices only (norm gains, vectors: none)."""
    pairs = model.named_parameters() if isinstance(model, nn.Module) else model
    named = [(n, p) for n, p in pairs if p.requires_grad]
    return [{"params": [(n, p) for n, p in named if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0}]


def normalize_groups(params: Iterable[Any]) -> list[tuple[dict[str, Any], list[NamedParam]]]:
    """Parameters, (name, parameter) pairs, or torch-style group dicts -> [(options, named)]."""
    items = list(params)
    if not items:
        raise ValueError("ZeroOptimizer got an empty parameter list")
    groups = items if isinstance(items[0], dict) else [{"params": items}]
    out, seen, k = [], set(), 0
    for g in groups:
        named: list[NamedParam] = []
        for x in g["params"]:
            name, p = x if isinstance(x, tuple) else (f"param{k}", x)
            if id(p) in seen:
                raise ValueError(f"parameter {name} appears twice in the optimizer's groups")
            seen.add(id(p))
            named.append((name, p))
            k += 1
        out.append(({key: v for key, v in g.items() if key != "params"}, named))
    return out


def check_options(stage: int, offload: bool, reduce_dtype: torch.dtype | None, offload_to: str,
                  offload_params: bool, sharded: ShardedModel | None) -> None:
    """Refuse a combination of ZeRO options that does not exist (each error says what would)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} must be 0, 1, 2 or 3")
    if offload and stage == 0:
        raise ValueError("optimizer offload needs ZeRO stage 1, 2 or 3 (stage 0 has no sharded optimizer)")
    if reduce_dtype is not None and reduce_dtype != torch.int8 and (stage == 0 or reduce_dtype not in LOW_PRECISION):
        raise ValueError(f"gradient compression reduce_dtype={reduce_dtype} needs torch.int8 (any stage), "
                         "or bf16 / fp16 with stage 1-3")
    if offload_to not in ("cpu", "disk"):
        raise ValueError(f"offload_to={offload_to!r} must be 'cpu' or 'disk'")
    if offload_to == "disk" and not offload:
        raise ValueError("offload_to='disk' places offloaded state: it needs offload=True")
    if offload_params and (stage != 3 or not offload):
        raise ValueError("offload_params needs ZeRO stage 3 and offload=True (the update runs where the "
                         "parameter shards live)")
    if (stage == 3) != (sharded is not None):
        raise ValueError("ZeRO stage 3 needs sharded=shard_model(model, axis, units); other stages take none")
