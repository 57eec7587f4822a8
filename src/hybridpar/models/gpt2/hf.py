"""GPT-2's Hugging Face mapping (``GPT2LMHeadModel``): weight names both ways and ``config.json``.

HF's GPT-2 stores its linears as ``Conv1D`` with weights ``[in, out]`` and fuses q, k and v into
one ``attn.c_attn`` (weight ``[dim, 3 * dim]``, bias ``[3 * dim]``, columns q | k | v). On import
:meth:`GPT2HF.to_ours` transposes each Conv1D weight to an ``nn.Linear`` one (``[out, in]``) and
splits ``c_attn`` into ``attention.wq``/``wk``/``wv``; :meth:`GPT2HF.to_hf` does the reverse.
The parts are read lazily: a tensor-parallel rank asking for its rows of ``wq`` reads only
those columns of ``c_attn`` from the safetensors file.

Keys may carry the ``transformer.`` prefix (what ``GPT2LMHeadModel.save_pretrained`` writes) or
not (the original OpenAI checkpoints, saved from ``GPT2Model``); the causal-mask buffers old
files hold (``attn.bias``, ``attn.masked_bias``) are skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from hybridpar.config import ModelConfig
from hybridpar.models.family import HFError, HFMapping, bad_value, rename_key
from hybridpar.models.lazy import shape_of, slice_bounds

__all__ = ["GPT2HF", "gpt2_config_from_hf", "to_hf_config_dict"]

PREFIX = "transformer."
_TOP = {
    "tok_embeddings.weight": "wte.weight",
    "pos_embeddings.weight": "wpe.weight",
    "norm.weight": "ln_f.weight",
    "norm.bias": "ln_f.bias",
}
# our module in a layer -> (HF module, Conv1D: weight stored [in, out])
_LAYER = {
    "attention_norm": ("ln_1", False),
    "ffn_norm": ("ln_2", False),
    "attention.wo": ("attn.c_proj", True),
    "feed_forward.w1": ("mlp.c_fc", True),
    "feed_forward.w2": ("mlp.c_proj", True),
}
_QKV = ("attention.wq", "attention.wk", "attention.wv")  # the thirds of attn.c_attn, in order
_TOP_INV = {v: k for k, v in _TOP.items()}
_LAYER_INV = {v[0]: k for k, v in _LAYER.items()}
_OURS_RE = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)")
_HF_RE = re.compile(r"h\.(\d+)\.(.+)\.(weight|bias)")
_BUFFER_RE = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)")  # old checkpoints' causal-mask buffers
HEAD = "lm_head.weight"

# ModelConfig field <- config.json key (and the alias GPT2Config also accepts)
_SHAPE_KEYS = {"dim": ("n_embd", "hidden_size"), "n_layers": ("n_layer", "num_hidden_layers"),
               "n_heads": ("n_head", "num_attention_heads"), "vocab_size": ("vocab_size", None),
               "max_seq_len": ("n_positions", "max_position_embeddings")}
ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # both GELU's tanh approximation


class ConvPart:
    """A lazily read HF ``Conv1D`` tensor (or the ``[start, stop)`` output columns of one: the q,
    k or v third of ``c_attn``) seen as our ``nn.Linear`` tensor: a weight transposed to
    ``[out, in]``, a bias ``[out]``. Like a safetensors slice it has ``get_shape()`` and is
    indexed with slices (``part[:]`` reads all of it); only the indexed part is read."""

    def __init__(self, src: Any, start: int, stop: int) -> None:
        self.src, self.start, self.stop = src, start, stop
        self.shape = shape_of(src)

    def get_shape(self) -> list[int]:
        out = self.stop - self.start
        return [out, self.shape[0]] if len(self.shape) == 2 else [out]

    def __getitem__(self, index: Any) -> Tensor:
        ours = self.get_shape()
        (r0, r1), *rest = slice_bounds(index, ours, "ConvPart")
        rows = slice(self.start + r0, self.start + r1)  # our rows = HF's output columns
        if len(ours) == 1:
            return self.src[rows]
        c0, c1 = rest[0]
        return self.src[c0:c1, rows].t().contiguous()


def gpt2_config_from_hf(c: Mapping[str, Any], where: str, name: str) -> ModelConfig:
    """The :class:`ModelConfig` of a ``GPT2Config`` ``config.json`` ``c`` (read from ``where``);
    :class:`HFError` naming key and value for what the model cannot represent exactly.
    Dropout probabilities are ignored: hybridpar trains without dropout (HF's eval mode)."""
    act = c.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise bad_value(where, "activation_function", act,
                        f"the MLP uses GELU's tanh approximation: {' or '.join(ACTIVATIONS)}")
    for key, want, why in (  # absent or null: GPT2Config's default, which is ``want``
        ("scale_attn_weights", True, "attention scores are always divided by sqrt(head_dim)"),
        ("scale_attn_by_inverse_layer_idx", False, "attention scores are not scaled per layer"),
        ("reorder_and_upcast_attn", False, "attention is the plain fused kernel"),
        ("add_cross_attention", False, "the model is a decoder without cross-attention"),
    ):
        if c.get(key) is not None and bool(c[key]) != want:
            raise bad_value(where, key, c[key], why)
    shape: dict[str, int] = {}
    missing = []
    for field, (key, alias) in _SHAPE_KEYS.items():
        value = c.get(key, c.get(alias) if alias else None)
        if value is None:
            missing.append(key)
        else:
            shape[field] = int(value)
    if missing:
        raise HFError(f"{where} lacks {', '.join(missing)}")
    if shape["dim"] % shape["n_heads"]:
        raise bad_value(where, "n_head", shape["n_heads"], f"n_embd = {shape['dim']} must be a multiple of it")
    tied = c.get("tie_word_embeddings")
    inner = c.get("n_inner")
    if inner is not None and not isinstance(inner, int):
        raise bad_value(where, "n_inner", inner, "an integer or null (= 4 * n_embd)")
    return ModelConfig(preset=f"hf:{name}", family="gpt2", **shape, n_kv_heads=shape["n_heads"],
                       ffn_hidden=inner or 4 * shape["dim"],
                       norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
                       tie_embeddings=True if tied is None else bool(tied))


def to_hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """``config.json`` for ``cfg`` (keyword arguments of ``transformers.GPT2Config`` too);
    dropouts 0.0, as hybridpar trains."""
    token = 50256 if cfg.vocab_size > 50256 else None  # GPT-2's <|endoftext|>, when it exists
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.dim,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.ffn_hidden,
        "n_positions": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": token,
        "eos_token_id": token,
    }


class GPT2HF(HFMapping):
    """``GPT2LMHeadModel``'s names; Conv1D weights transposed and ``c_attn`` split/fused."""

    model_type, architecture = "gpt2", "GPT2LMHeadModel"

    def hf_key(self, name: str) -> str:
        """HF key holding our parameter ``name`` (``attention.wq`` etc.: the fused ``c_attn``)."""
        if name == "output.weight":
            return HEAD
        if name in _TOP:
            return PREFIX + _TOP[name]
        m = _OURS_RE.fullmatch(name)
        if m is None:
            raise KeyError(f"no Hugging Face name for parameter {name!r}")
        layer, module, kind = m.groups()
        if module in _QKV:
            return f"{PREFIX}h.{layer}.attn.c_attn.{kind}"
        if module not in _LAYER:
            raise KeyError(f"no Hugging Face name for parameter {name!r}")
        return f"{PREFIX}h.{layer}.{_LAYER[module][0]}.{kind}"

    def from_hf_key(self, key: str) -> str:
        """Our name for HF ``key`` (with or without ``transformer.``); KeyError for the fused
        ``c_attn`` (three of ours: see :meth:`to_ours`) and unknown keys."""
        if key == HEAD:
            return "output.weight"
        ours = rename_key(key.removeprefix(PREFIX), _TOP_INV, _HF_RE, _LAYER_INV, "layers.{}.{}.{}")
        if ours is None:
            raise KeyError(f"no single hybridpar name for Hugging Face key {key!r}")
        return ours

    def config_from_hf(self, c: Mapping[str, Any], where: str, name: str) -> ModelConfig:
        return gpt2_config_from_hf(c, where, name)

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        return to_hf_config_dict(cfg)

    def to_ours(self, hf: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
        for key, value in hf.items():
            bare = key.removeprefix(PREFIX)
            if _BUFFER_RE.fullmatch(bare):
                continue
            m = _HF_RE.fullmatch(bare)
            if m is not None and m.group(2) == "attn.c_attn":
                layer, kind = m.group(1), m.group(3)
                size = shape_of(value)[-1]
                if size % 3:
                    raise HFError(f"{key} has shape {shape_of(value)}: its last dim must be 3 * n_embd (q | k | v)")
                third = size // 3
                for i, ours in enumerate(_QKV):
                    yield f"layers.{layer}.{ours}.{kind}", ConvPart(value, i * third, (i + 1) * third)
                continue
            try:
                name = self.from_hf_key(key)
            except KeyError:
                yield key, value
                continue
            conv = m is not None and _LAYER[_LAYER_INV[m.group(2)]][1]
            if conv and m.group(3) == "weight":
                shape = shape_of(value)
                if len(shape) != 2:
                    raise HFError(f"{key} has shape {shape}; a Conv1D weight is [in, out]")
                yield name, ConvPart(value, 0, shape[1])
            else:
                yield name, value

    def to_hf(self, ours: Mapping[str, Tensor]) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        for name, t in ours.items():
            m = _OURS_RE.fullmatch(name)
            if m is not None and m.group(2) in _QKV:
                if m.group(2) != _QKV[0]:
                    continue  # fused with wq's entry
                layer, kind = m.group(1), m.group(3)
                parts = [ours[f"layers.{layer}.{q}.{kind}"] for q in _QKV]
                fused = torch.cat(parts, 0)
                out[f"{PREFIX}h.{layer}.attn.c_attn.{kind}"] = fused.t() if kind == "weight" else fused
                continue
            key = self.hf_key(name)
            conv = m is not None and _LAYER[m.group(2)][1] and m.group(3) == "weight"
            out[key] = t.t() if conv else t
        return out
