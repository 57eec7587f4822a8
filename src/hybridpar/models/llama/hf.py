"""Llama's Hugging Face mapping (``LlamaForCausalLM``): weight names both ways and ``config.json``.

:func:`llama_config_from_hf` also reads the Llama-like families' configs (Qwen2, Qwen3,
Mistral): they share these keys and differ in a few features their folders check.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hybridpar.config import ModelConfig
from hybridpar.models.family import HFError, HFMapping, bad_value, rename_key, unexportable

__all__ = ["LlamaHF", "from_hf_key", "hf_key", "llama_config_from_hf", "llama_hf_config", "to_hf_config_dict"]

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


def llama_config_from_hf(c: Mapping[str, Any], where: str, name: str, *, family: str,
                         qkv_bias: bool = False, qk_norm: bool = False, default_theta: float = 10000.0) -> ModelConfig:
    """The :class:`ModelConfig` of a Llama-like ``config.json`` ``c`` (read from ``where``);
    :class:`HFError` naming key and value for what the model cannot represent exactly.
    ``default_theta``: the RoPE base transformers uses for this family when ``c`` names none."""
    for key in ("rope_scaling", "rope_parameters"):
        kind = _rope_type(c.get(key))
        if kind not in (None, "default"):
            raise bad_value(where, key, c[key], "RoPE scaling is not implemented; only rope_type 'default'")
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
                       qkv_bias=qkv_bias, qk_norm=qk_norm, kv_channels=kv_channels)


def llama_hf_config(cfg: ModelConfig, model_type: str, architecture: str, moe: bool = False) -> dict[str, Any]:
    """``config.json`` for a Llama-like model; ``rope_theta`` both flat (transformers 4.x) and
    as ``rope_parameters`` (5.x). A model with experts is refused unless the family states them
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
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
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
