"""The options of a :class:`~hybridpar.parallel.zero.optimizer.ZeroOptimizer`: its parameter
groups (:func:`decay_groups`, :func:`normalize_groups`), the gradient compression names
(:data:`COMPRESSION_DTYPES`), which combinations of stage, offload and compression exist
(:func:`check_options`) and which kernel runs the update (:func:`impl_kwargs`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from hybridpar.compat import fused_optimizer_devices
from hybridpar.parallel.zero.stage import LOW_PRECISION, NamedParam
from hybridpar.parallel.zero.zero3 import ShardedModel
from hybridpar.rules import optimizer_impl_error

__all__ = ["COMPRESSION_DTYPES", "check_options", "decay_groups", "fused_unsupported", "impl_kwargs", "kernel_of",
           "normalize_groups"]

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


def fused_unsupported(optimizer_cls: type[torch.optim.Optimizer], tensors: Sequence[torch.Tensor]) -> str | None:
    """Why torch's fused kernel cannot step ``tensors`` with ``optimizer_cls``, or None if it can.

    It needs an optimizer that has one (``fused=`` in its signature: Adam, AdamW, SGD, Adagrad),
    floating tensors on a device it supports (:func:`~hybridpar.compat.fused_optimizer_devices`)
    and contiguous ones: the CPU kernel walks each tensor's memory linearly, so a strided view
    would be updated at the wrong elements without an error.
    """
    if "fused" not in inspect.signature(optimizer_cls).parameters:
        return f"{optimizer_cls.__name__} has no fused kernel"
    devices = fused_optimizer_devices()
    for t in tensors:
        if not torch.is_floating_point(t) or t.device.type not in devices:
            return f"torch has no fused kernel for {t.dtype} tensors on {t.device.type}"
        if not t.is_contiguous():
            return "the fused kernel needs contiguous tensors"
    return None


def impl_kwargs(optimizer_cls: type[torch.optim.Optimizer], impl: str, tensors: Sequence[torch.Tensor],
                given: dict[str, Any]) -> dict[str, bool]:
    """The ``fused`` / ``foreach`` arguments that make ``optimizer_cls`` run ``impl`` on ``tensors``
    (the tensors it will step: this rank's shards, fp32 masters or host copies).

    ``"auto"``: fused wherever :func:`fused_unsupported` allows, else torch's own default
    (foreach on CUDA, a per-tensor loop on CPU); ``"fused"``: refused where it does not apply;
    ``"foreach"``: torch's multi-tensor kernels; ``"for-loop"``: one tensor at a time. Arguments
    the caller passes itself (``given``) win under ``"auto"`` and conflict with any other choice.
    """
    error = optimizer_impl_error(impl, "optimizer_impl")
    if error is not None:
        raise ValueError(error)
    chosen = {"fused", "foreach"} & given.keys()
    if chosen:
        if impl != "auto":
            raise ValueError(f"optimizer_impl = {impl!r} and {sorted(chosen)} given to the optimizer both choose "
                             "its kernel; pass one of them")
        return {}
    takes = inspect.signature(optimizer_cls).parameters
    if impl == "auto":  # (torch has no fused differentiable step)
        fusable = fused_unsupported(optimizer_cls, tensors) is None and not given.get("differentiable")
        return {"fused": True} if fusable else {}
    if impl == "fused":
        why = fused_unsupported(optimizer_cls, tensors)
        if why is not None:
            raise ValueError(f"optimizer_impl = 'fused': {why}; use 'auto', 'foreach' or 'for-loop'")
        return {"fused": True}
    if "foreach" not in takes:
        if impl == "foreach":
            raise ValueError(f"optimizer_impl = 'foreach': {optimizer_cls.__name__} has no foreach kernels; use "
                             "'auto' or 'for-loop'")
        return {}  # an optimizer without the choice steps one tensor at a time
    return {"foreach": impl == "foreach"}


def kernel_of(optimizer: torch.optim.Optimizer) -> str:
    """Which kernel ``optimizer`` updates with: ``"fused"``, ``"foreach"`` or ``"for-loop"``. Left to
    torch (neither asked for), foreach runs where every tensor is on a GPU (CUDA, XPU)."""
    defaults = optimizer.defaults
    if defaults.get("fused"):
        return "fused"
    foreach = defaults.get("foreach")
    if foreach is None:
        foreach = all(p.device.type in ("cuda", "xpu") for g in optimizer.param_groups for p in g["params"])
    return "foreach" if foreach else "for-loop"
