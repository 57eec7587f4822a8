"""What a model family is to the rest of hybridpar: one :class:`Family` value per folder.

The engine, checkpoints, the HF importer and the CLI ask a family, never a model class, for
everything model-specific: how to build and initialise it, which parameters tensor parallelism
splits and how its layers become parallel ones, which modules are attention (context parallelism,
selective recompute), blocks (full recompute, ZeRO-3 units) and pipeline chunks, and how its
weights and ``config.json`` map to Hugging Face's. ``hybridpar.parallel`` stays generic: it gets
these modules and callables handed in. See ``docs/howto/add-model-family.md``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from hybridpar.config import ConfigError, ModelConfig
from hybridpar.distributed.mesh import Axis
from hybridpar.parallel.pipeline.partition import ChunkSpec
from hybridpar.parallel.tensor_plan import TensorPlan

__all__ = ["Family", "HFError", "HFMapping"]


class HFError(ConfigError):
    """A Hugging Face directory this model cannot load; the message names file, key and value."""


class HFMapping:
    """A family's Hugging Face names, both ways. The default is a one-to-one renaming through
    ``hf_key``/``from_hf_key``; a family whose HF tensors are fused or transposed (GPT-2's Conv1D
    ``c_attn``) overrides :meth:`to_ours` and :meth:`to_hf`."""

    #: ``model_type`` and ``architectures`` written to an exported ``config.json``
    model_type: str = ""
    architecture: str = ""

    def hf_key(self, name: str) -> str:
        """Our parameter name -> the HF state-dict key (KeyError if unknown)."""
        raise NotImplementedError

    def from_hf_key(self, key: str) -> str:
        """HF state-dict key -> our parameter name (KeyError if unknown)."""
        raise NotImplementedError

    def config_from_hf(self, c: Mapping[str, Any], where: str, name: str) -> ModelConfig:
        """The :class:`ModelConfig` a ``config.json`` describes; :class:`HFError` naming the key
        and value for anything this family cannot represent exactly."""
        raise NotImplementedError

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        """``config.json`` contents describing ``cfg`` (``model_type`` and ``architectures`` included)."""
        raise NotImplementedError

    def to_ours(self, hf: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        """``(our name, tensor or lazy slice)`` for HF tensors ``hf`` (key -> tensor or lazy
        safetensors slice). Unknown keys come back as ``(key, value)`` for the caller to report."""
        for key, value in hf.items():
            try:
                yield self.from_hf_key(key), value
            except KeyError:
                yield key, value

    def to_hf(self, ours: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """Our full (tp=1) state dict -> HF state dict."""
        return {self.hf_key(k): v for k, v in ours.items()}


def rename_key(key: str, top: Mapping[str, str], layer_re: re.Pattern[str], layers: Mapping[str, str],
               template: str) -> str | None:
    """``key`` renamed through a family's tables: ``top`` for whole names, else a layer's parameter
    (``layer_re`` matches layer index, module, ``weight|bias``) whose module ``layers`` renames,
    spelled ``template.format(layer, module, kind)``. None when neither knows it."""
    if key in top:
        return top[key]
    m = layer_re.fullmatch(key)
    if m is None or m.group(2) not in layers:
        return None
    return template.format(m.group(1), layers[m.group(2)], m.group(3))


def bad_value(where: str, key: str, value: Any, why: str) -> HFError:
    """The one-line error for a ``config.json`` value a family cannot represent."""
    return HFError(f"{where}: {key} = {json.dumps(value)} is not supported ({why})")


def unexportable(key: str, value: Any, architecture: str, why: str) -> HFError:
    """The one-line error for a ``model.*`` value a family's Hugging Face config cannot state."""
    return HFError(f"model.{key} = {json.dumps(value)} cannot be exported to {architecture}: {why}")


@dataclass(frozen=True)
class Family:
    """One model family: its math, its parallel plan and its Hugging Face mapping."""

    name: str
    build: Callable[[ModelConfig], nn.Module]  # the model, with init_weights(seed)
    tp: TensorPlan
    parallelize: Callable[[nn.Module, Axis, bool], nn.Module]  # (model, tp axis, sequence_parallel)
    attention_modules: Callable[[nn.Module], list[nn.Module]]  # each has core(q, k, v, docs=None)
    blocks: Callable[[nn.Module], list[nn.Module]]  # decoder layers: full recompute
    zero3_units: Callable[[nn.Module], list[nn.Module]]
    make_chunk: Callable[[nn.Module, ChunkSpec], nn.Module]  # a pipeline stage's part of the model
    hf: HFMapping
    #: (model, tp, ep, axes a micro-batch's tokens are split over, sequence_parallel): the MoE
    #: layers' plan (expert parallelism); None for a family without MoE layers
    parallelize_moe: Callable[[nn.Module, Axis, Axis, list[Axis], bool], nn.Module] | None = None
