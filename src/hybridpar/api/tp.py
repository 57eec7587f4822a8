"""Tensor parallelism for any model through a plan, and the tp-aware helpers that go with it.

A plan maps module-name patterns (:func:`fnmatch.fnmatchcase`, e.g. ``"layers.*.attn.q"``) to
a style: ``"column"`` (an ``nn.Linear`` split along its outputs), ``"row"`` (split along its
inputs, output summed over tp), ``"embedding"`` (an ``nn.Embedding`` split along the
vocabulary). A style may also be a dict ``{"style": "column", "gather_output": True, ...}``
whose other keys go to the parallel layer (e.g. ``gather_output`` for an output head whose full
logits the loss needs). :func:`parallelize_module` swaps the matched modules for
:class:`~hybridpar.parallel.tensor.ColumnParallelLinear`,
:class:`~hybridpar.parallel.tensor.RowParallelLinear` or
:class:`~hybridpar.parallel.tensor.VocabParallelEmbedding` built with ``from_full``, so a model
initialised identically on every rank gets shards that concatenate to the original weights.

The model code must not depend on the number of heads or features as constants: a column
layer's output has ``out / tp`` features (Hugging Face Llama-style attention reshapes with ``-1``
heads and works unchanged).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from hybridpar.distributed.mesh import Axis, Topology
from hybridpar.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from hybridpar.parallel.tensor_plan import TensorPlan

__all__ = ["TP_STYLES", "full_tensor_parallel_state_dict", "global_grad_norm", "parallelize_module",
           "tp_sharded_params"]

TP_STYLES = ("column", "row", "embedding")
PlanStyle = str | Mapping[str, Any]


def _style(name: str, spec: PlanStyle) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, str):
        style, kwargs = spec, {}
    else:
        kwargs = dict(spec)
        style = kwargs.pop("style", None)
    if style not in TP_STYLES:
        raise ValueError(f"tensor-parallel plan entry {name!r}: style {style!r} is not one of {TP_STYLES}")
    return style, kwargs


def _swap(module: nn.Module, style: str, kwargs: dict[str, Any], axis: Axis, name: str) -> nn.Module:
    if style == "embedding":
        if type(module) is not nn.Embedding:
            raise ValueError(f"tensor-parallel plan: {name!r} is {type(module).__name__}, style 'embedding' "
                             "needs an nn.Embedding")
        if module.padding_idx is not None or module.max_norm is not None:
            raise ValueError(f"tensor-parallel plan: embedding {name!r} uses padding_idx/max_norm, which "
                             "VocabParallelEmbedding does not support; build it with padding_idx=None")
        return VocabParallelEmbedding.from_full(module.weight.detach(), axis, **kwargs)
    if type(module) is not nn.Linear:
        raise ValueError(f"tensor-parallel plan: {name!r} is {type(module).__name__}, style {style!r} "
                         "needs an nn.Linear")
    bias = None if module.bias is None else module.bias.detach()
    cls = ColumnParallelLinear if style == "column" else RowParallelLinear
    return cls.from_full(module.weight.detach(), axis, bias, **kwargs)


def parallelize_module(model: nn.Module, axis: Axis, plan: Mapping[str, PlanStyle]) -> nn.Module:
    """Replace the modules of ``model`` matched by ``plan`` with tensor-parallel layers over
    ``axis``, in place, and return ``model``. The first matching pattern wins; a pattern that
    matches nothing is an error (a typo would otherwise silently train unsplit). At tp=1 the
    model is left unchanged. Build the optimizer afterwards (parameters are replaced).

    Raises ``ValueError`` for a style that does not fit the module, for sizes tp does not divide,
    and for a matched weight shared with another module (tied weights would come apart)."""
    styles = {pattern: _style(pattern, spec) for pattern, spec in plan.items()}
    names = [name for name, _ in model.named_modules() if name]
    for pattern in styles:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ValueError(f"tensor-parallel plan pattern {pattern!r} matches no module of the model; "
                             f"module names look like {names[:6]}")
    if axis.size == 1:
        return model
    uses: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    for name in names:
        match = next((s for pattern, s in styles.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if match is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, attr)
        if any(uses.get(id(p), 0) > 1 for p in module.parameters(recurse=False)):
            raise ValueError(f"tensor-parallel plan: {name!r} shares its weight with another module (tied "
                             "embeddings?); untie it before splitting")
        setattr(parent, attr, _swap(module, *match, axis, name))
    return model


def tp_sharded_params(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{parameter name: (split dim, full size along it)}`` for every parameter of ``model``
    that is split over a tensor-parallel axis of size > 1 (found by layer type); the rest are
    replicated on every tp rank."""
    out: dict[str, tuple[int, int]] = {}
    for prefix, m in model.named_modules():
        dot = prefix + "." if prefix else ""
        if getattr(getattr(m, "axis", None), "size", 1) <= 1:
            continue
        if isinstance(m, ColumnParallelLinear):
            out[dot + "weight"] = (0, m.out_features)
            if m.bias is not None:
                out[dot + "bias"] = (0, m.out_features)
        elif isinstance(m, RowParallelLinear):
            out[dot + "weight"] = (1, m.in_features)
        elif isinstance(m, VocabParallelEmbedding):
            out[dot + "weight"] = (0, m.num_embeddings)
    return out


@torch.no_grad()
def full_tensor_parallel_state_dict(state: Mapping[str, Tensor], sharded: Mapping[str, tuple[int, int]],
                                    axis: Axis) -> dict[str, Tensor]:
    """The tp=1 state dict from this rank's (``sharded`` as given by :func:`tp_sharded_params`):
    split tensors all-gathered along their dim, vocabulary padding dropped. Collective over ``axis``."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        if name in sharded and axis.size > 1:
            dim, size = sharded[name]
            t = axis.comm.all_gather(t.contiguous(), axis, dim).narrow(dim, 0, size)
        out[name] = t.detach().clone()
    return out


def global_grad_norm(named_grads: Iterable[tuple[str, Tensor]], topo: Topology,
                     tp_sharded: Iterable[str], reduce_over: Iterable[Axis] = ()) -> Tensor:
    """The L2 norm of the whole model's gradient, the same on every rank: each rank's squares of
    the gradients it holds, summed over ``reduce_over`` (the axes that split parameters between
    ranks, e.g. ZeRO's dp shards and the pipeline stages) and, for the ``tp_sharded`` names, over
    tp; tp-replicated gradients are counted once (:meth:`TensorPlan.global_grad_norm`, the norm
    every front door uses)."""
    plan = TensorPlan.of_names(dict.fromkeys(tp_sharded, 0))  # the split dim does not matter here
    return plan.global_grad_norm(named_grads, topo.tp, reduce_over, topo.device)
