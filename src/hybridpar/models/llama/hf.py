"""Llama's Hugging Face mapping (``LlamaForCausalLM``): weight names both ways and ``config.json``.

:func:`llama_config_from_hf` also reads the Llama-like families' configs (Qwen2, Qwen3,
Mistral): they share these keys and differ in a few features their folders check.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from hybridpar.config import ModelConfig
from hybridpar.models.family import HFError, HFMapping, bad_value, rename_key, unexportable
from hybridpar.models.rope import ROPE_TYPES

__all__ = ["LlamaHF", "from_hf_key", "hf_key", "llama_config_from_hf", "llama_hf_config", "rope_fields",
           "to_hf_config_dict"]

_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_INV = {v: k for k, v in _TOP.items()}
_LAYER_INV = {v: k for k, v in _LAYER.items()}
_OURS_RE = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_HF_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
# HF config key -> ModelConfig field
_SHAPE_KEYS = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
               "intermediate_size": "ffn_hidden", "vocab_size": "vocab_size",
               "max_position_embeddings": "max_seq_len"}


def _rope_type(rope: Any) -> str | None:
    if rope is None:
        return None
    if not isinstance(rope, dict):
        return str(rope)
    return rope.get("rope_type", rope.get("type"))


def _yarn_attention_factor(p: Mapping[str, Any], factor: float) -> float:
    """transformers' yarn temperature when the config states none: from ``mscale`` and
    ``mscale_all_dim`` when both are set, else 0 (= ``0.1 ln(factor) + 1``, derived later)."""
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        return 0.0

    def get_mscale(scale: float, m: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)


def rope_fields(c: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The ``ModelConfig`` ``rope_*`` fields of ``c``'s ``rope_parameters`` (transformers 5.x) or
    ``rope_scaling`` (4.x); :class:`HFError` naming the key for a type :mod:`~hybridpar.models.rope`
    does not implement (e.g. ``longrope``)."""
    key = next((k for k in ("rope_parameters", "rope_scaling") if _rope_type(c.get(k)) not in (None, "default")), None)
    if key is None:
        return {}
    p, kind = c[key], _rope_type(c[key])
    if kind not in ROPE_TYPES:
        raise bad_value(where, key, p, f"rope_type {kind!r} is not implemented; supported: {', '.join(ROPE_TYPES)}")
    max_len = c.get("max_position_embeddings", 0)
    original = c.get("original_max_position_embeddings") or p.get("original_max_position_embeddings") or max_len
    factor = p.get("factor")
    if factor is None and kind == "yarn" and original:
        factor = max_len / original
    if factor is None:
        raise bad_value(where, key, p, f"rope_type {kind!r} needs a factor")
    out: dict[str, Any] = {"rope_type": kind, "rope_factor": float(factor)}
    if kind == "llama3":
        out.update(rope_original_max_len=int(original), rope_low_freq_factor=float(p["low_freq_factor"]),
                   rope_high_freq_factor=float(p["high_freq_factor"]))
    if kind == "yarn":
        out.update(rope_original_max_len=int(original), rope_beta_fast=float(p.get("beta_fast") or 32),
                   rope_beta_slow=float(p.get("beta_slow") or 1), rope_truncate=bool(p.get("truncate", True)),
                   rope_attention_factor=_yarn_attention_factor(p, float(factor)))
    return out


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """``rope_parameters`` of ``cfg`` for ``config.json`` (the inverse of :func:`rope_fields`)."""
    out: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
    if cfg.rope_type != "default":
        out["factor"] = cfg.rope_factor
    if cfg.rope_type in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = cfg.rope_original_max_len or cfg.max_seq_len
    if cfg.rope_type == "llama3":
        out.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor)
    if cfg.rope_type == "yarn":
        out.update(beta_fast=cfg.rope_beta_fast, beta_slow=cfg.rope_beta_slow, truncate=cfg.rope_truncate)
        if cfg.rope_attention_factor:
            out["attention_factor"] = cfg.rope_attention_factor
    return out


def _rope_scaling(cfg: ModelConfig) -> dict[str, Any] | None:
    """``rope_scaling`` for transformers 4.x and serving engines that read only that key: the same
    parameters as ``rope_parameters`` without ``rope_theta``; None (4.x's "unscaled") for the
    default rotation. Without it such a reader would run unscaled RoPE with no error."""
    if cfg.rope_type == "default":
        return None
    return {k: v for k, v in _rope_parameters(cfg).items() if k != "rope_theta"}


def llama_config_from_hf(c: Mapping[str, Any], where: str, name: str, *, family: str,
                         qkv_bias: bool = False, qk_norm: bool = False, default_theta: float = 10000.0) -> ModelConfig:
    """The :class:`ModelConfig` of a Llama-like ``config.json`` ``c`` (read from ``where``);
    :class:`HFError` naming key and value for what the model cannot represent exactly.
    ``default_theta``: the RoPE base transformers uses for this family when ``c`` names none."""
    rope_scaling = rope_fields(c, where)
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key, False):
            raise bad_value(where, key, c[key], f"{family} has no biases there")
    if c.get("hidden_act", "silu") != "silu":
        raise bad_value(where, "hidden_act", c["hidden_act"], "the MLP is SwiGLU with silu")
    if c.get("attention_dropout", 0.0):
        raise bad_value(where, "attention_dropout", c["attention_dropout"], "the model has no dropout")
    missing = [k for k in (*_SHAPE_KEYS, "rms_norm_eps") if k not in c]
    if missing:
        raise HFError(f"{where} lacks {', '.join(missing)}")
    rope = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
    theta = c.get("rope_theta", rope.get("rope_theta", default_theta))
    shape = {field: c[key] for key, field in _SHAPE_KEYS.items()}
    heads = shape["n_heads"]
    head_dim = c.get("head_dim") or shape["dim"] // heads
    kv_channels = 0 if head_dim * heads == shape["dim"] else head_dim
    return ModelConfig(preset=f"hf:{name}", family=family, **shape,
                       n_kv_heads=c.get("num_key_value_heads") or heads, rope_theta=float(theta),
                       norm_eps=float(c["rms_norm_eps"]), tie_embeddings=bool(c.get("tie_word_embeddings", False)),
                       qkv_bias=qkv_bias, qk_norm=qk_norm, kv_channels=kv_channels, **rope_scaling)


def llama_hf_config(cfg: ModelConfig, model_type: str, architecture: str, moe: bool = False) -> dict[str, Any]:
    """``config.json`` for a Llama-like model; the RoPE both as transformers 4.x reads it (flat
    ``rope_theta``, ``rope_scaling``) and as 5.x does (``rope_parameters``). A model with experts is refused unless the family states them
    (``moe``: Mixtral, Qwen3-MoE)."""
    if cfg.n_experts and not moe:
        raise unexportable("n_experts", cfg.n_experts, architecture, f"{model_type} has no mixture-of-experts "
                           "layers; train with --model.family mixtral or qwen3_moe to export experts")
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": 0.02,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": _rope_parameters(cfg),
        "rope_scaling": _rope_scaling(cfg),
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
    }


class LlamaHF(HFMapping):
    """``LlamaForCausalLM``'s names: one-to-one with ours (``wq`` = ``q_proj``, ...)."""

    model_type, architecture = "llama", "LlamaForCausalLM"

    def hf_key(self, name: str) -> str:
        hf = rename_key(name, _TOP, _OURS_RE, _LAYER, "model.layers.{}.{}.{}")
        if hf is None:
            raise KeyError(f"no Hugging Face name for parameter {name!r}")
        return hf

    def from_hf_key(self, key: str) -> str:
        ours = rename_key(key, _TOP_INV, _HF_RE, _LAYER_INV, "layers.{}.{}.{}")
        if ours is None:
            raise KeyError(f"no hybridpar name for Hugging Face key {key!r}")
        return ours

    def config_from_hf(self, c: Mapping[str, Any], where: str, name: str) -> ModelConfig:
        return llama_config_from_hf(c, where, name, family=self.model_type)

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        return {**llama_hf_config(cfg, self.model_type, self.architecture), "attention_bias": False,
                "mlp_bias": False}



_MAPPING = LlamaHF()
hf_key = _MAPPING.hf_key
from_hf_key = _MAPPING.from_hf_key


def to_hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """Keyword arguments for ``transformers.LlamaConfig(**d)`` describing the same model."""
    return _MAPPING.to_hf_config(cfg)
