"""Hugging Face ``LlamaForCausalLM`` weights in and out: ``config.json`` + safetensors.

Reading goes through the ``safetensors`` library only (never ``torch.load``/pickle), from
``model.safetensors`` or a sharded ``model.safetensors.index.json``. Names are translated with
:func:`~hybridpar.models.llama.hf_key`; anything this model cannot represent exactly (RoPE
scaling, biases, another activation) is rejected with one message naming the key and value.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from hybridpar.config import ConfigError, ModelConfig
from hybridpar.fsutil import publish_modes
from hybridpar.models.llama import Llama, from_hf_key, hf_key, to_hf_config_dict

__all__ = ["HFError", "check_same_shape", "cmd_convert", "init_from_hf", "load_hf_state_dict",
           "model_config_from_hf", "save_hf"]

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
# HF config key -> ModelConfig field
_SHAPE_KEYS = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
               "intermediate_size": "ffn_hidden", "vocab_size": "vocab_size",
               "max_position_embeddings": "max_seq_len"}
# Keys some checkpoints carry that hold no parameters of the model (old RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFError(ConfigError):
    """A Hugging Face directory this model cannot load; the message names file, key and value."""


def _read_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise HFError(f"{str(path)!r} does not exist; point at a Hugging Face model directory "
                      "(config.json + model.safetensors)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFError(f"{str(path)!r} is not valid JSON: {e}") from None


def _rope_type(rope: Any) -> str | None:
    if rope is None:
        return None
    if not isinstance(rope, dict):
        return str(rope)
    return rope.get("rope_type", rope.get("type"))


def model_config_from_hf(hf_dir: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` of the Llama model in ``hf_dir/config.json``; rejects what we
    cannot represent exactly, naming the key and value."""
    if (Path(hf_dir) / "complete.json").is_file():  # has a config.json too, but hybridpar's own
        raise HFError(f"{str(hf_dir)!r} is a hybridpar checkpoint, not a Hugging Face model directory: continue "
                      f"training from it with --resume {hf_dir}, or export it with "
                      f"`hybridpar convert {hf_dir} --to-hf DIR` and start from DIR")
    c = _read_config(hf_dir)
    where = str(Path(hf_dir) / "config.json")

    def bad(key: str, value: Any, why: str) -> HFError:
        return HFError(f"{where}: {key} = {json.dumps(value)} is not supported ({why})")

    if c.get("model_type") != "llama":
        raise bad("model_type", c.get("model_type"), "only 'llama' (LlamaForCausalLM) models load")
    for key in ("rope_scaling", "rope_parameters"):
        kind = _rope_type(c.get(key))
        if kind not in (None, "default"):
            raise bad(key, c[key], "RoPE scaling is not implemented; only rope_type 'default'")
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key, False):
            raise bad(key, c[key], "the model has no biases")
    if c.get("hidden_act", "silu") != "silu":
        raise bad("hidden_act", c["hidden_act"], "the MLP is SwiGLU with silu")
    if c.get("attention_dropout", 0.0):
        raise bad("attention_dropout", c["attention_dropout"], "the model has no dropout")
    missing = [k for k in (*_SHAPE_KEYS, "rms_norm_eps") if k not in c]
    if missing:
        raise HFError(f"{where} lacks {', '.join(missing)}")
    rope = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))  # HF's default when absent
    shape = {field: c[key] for key, field in _SHAPE_KEYS.items()}
    heads = shape["n_heads"]
    head_dim = c.get("head_dim") or shape["dim"] // heads
    if head_dim * heads != shape["dim"]:
        raise bad("head_dim", head_dim, f"must equal hidden_size / num_attention_heads = {shape['dim']} / {heads}")
    return ModelConfig(preset=f"hf:{Path(hf_dir).name}", **shape,
                       n_kv_heads=c.get("num_key_value_heads") or heads, rope_theta=float(theta),
                       norm_eps=float(c["rms_norm_eps"]), tie_embeddings=bool(c.get("tie_word_embeddings", False)))


def check_same_shape(hf: ModelConfig, ours: ModelConfig, source: str) -> None:
    """HFError (a ValueError) naming every ModelConfig field (except ``preset``) where ``hf`` != ``ours``."""
    diffs = []
    for f in dataclasses.fields(ModelConfig):
        a, b = getattr(hf, f.name), getattr(ours, f.name)
        same = math.isclose(a, b, rel_tol=1e-9) if isinstance(a, float) else a == b
        if f.name != "preset" and not same:
            diffs.append((f.name, a, b))
    if diffs:
        said = "; ".join(f"model.{k} = {b} in the config but {a} in the weights" for k, a, b in diffs)
        flags = " ".join(f"--model.{k} {str(a).lower() if isinstance(a, bool) else a}" for k, a, _ in diffs)
        raise HFError(f"train.init_from = {source!r} does not fit the configured model: {said}. "
                         f"Set model.* to match ({flags}) or use --model.preset with that shape")


def _expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        return {name: p.shape for name, p in Llama(cfg).named_parameters()}


def _check_state(state: dict[str, Tensor], cfg: ModelConfig, name: Any, source: str) -> None:
    """One error naming the first missing, unexpected or wrongly shaped key (``name`` maps our
    names to the names shown)."""
    expected = _expected_shapes(cfg)
    for key in expected:
        if key not in state:
            raise HFError(f"{source}: tensor {name(key)!r} is missing")
    for key, t in state.items():
        if key not in expected:
            raise HFError(f"{source}: unexpected tensor {name(key)!r} for this model config")
        if t.shape != expected[key]:
            raise HFError(f"{source}: tensor {name(key)!r} has shape {list(t.shape)}, "
                          f"the config needs {list(expected[key])}")


def _tensor_files(hf_dir: Path) -> dict[str, list[str]]:
    """safetensors file -> the tensor keys it holds (from the index when sharded)."""
    if (hf_dir / INDEX).is_file():
        weight_map = json.loads((hf_dir / INDEX).read_text()).get("weight_map", {})
        files: dict[str, list[str]] = {}
        for key, fname in weight_map.items():
            if Path(fname).name != fname:
                raise HFError(f"{hf_dir / INDEX}: shard {fname!r} of {key!r} is not a file in the directory")
            files.setdefault(fname, []).append(key)
        return files
    if (hf_dir / WEIGHTS).is_file():
        return {WEIGHTS: []}  # [] = every key in the file
    raise HFError(f"{str(hf_dir)!r} has neither {WEIGHTS} nor {INDEX} (only safetensors weights load)")


def load_hf_state_dict(hf_dir: str | Path, cfg: ModelConfig | None = None,
                       read: Callable[[str, Any], Tensor] | None = None) -> dict[str, Tensor]:
    """The weights in ``hf_dir`` as our state dict (our names, stored dtype, CPU), checked
    against ``cfg`` (default: :func:`model_config_from_hf`). A tied ``lm_head`` must be absent
    or equal to the embedding.

    ``read(our_name, lazy_slice)`` may pick part of each tensor from safetensors' lazy slice
    (e.g. one tensor-parallel shard), so only that part is read from disk; shapes are checked
    on the full tensors first."""
    hf_dir = Path(hf_dir)
    cfg = cfg or model_config_from_hf(hf_dir)
    if read is None:
        return _load(hf_dir, cfg, lambda name, sl: sl[:], check=True)
    _load(hf_dir, cfg, lambda name, sl: torch.empty(sl.get_shape(), device="meta"), check=True)  # no data read
    return _load(hf_dir, cfg, read, check=False)


def _load(hf_dir: Path, cfg: ModelConfig, read: Callable[[str, Any], Tensor], check: bool) -> dict[str, Tensor]:
    raw: dict[str, Tensor] = {}
    for fname, keys in _tensor_files(hf_dir).items():
        if not (hf_dir / fname).is_file():
            raise HFError(f"{str(hf_dir / fname)!r} is listed in {INDEX} but does not exist")
        with safe_open(str(hf_dir / fname), framework="pt") as f:
            present = set(f.keys())
            for key in keys or sorted(present):
                if key not in present:
                    raise HFError(f"{hf_dir / INDEX} maps {key!r} to {fname}, which lacks it")
                raw[key] = read(_our_name(key), f.get_slice(key))
    head, embed = raw.get(hf_key("output.weight")), raw.get(hf_key("tok_embeddings.weight"))
    if cfg.tie_embeddings and head is not None:
        same = head.is_meta or torch.equal(head, embed) if embed is not None and head.shape == embed.shape else False
        if not same:
            raise HFError(f"{hf_dir}: tie_word_embeddings is true but lm_head.weight differs from "
                          "model.embed_tokens.weight")
        del raw[hf_key("output.weight")]
    state = {}
    for key, t in raw.items():
        if key.endswith(_IGNORED_SUFFIXES):
            continue
        try:
            state[from_hf_key(key)] = t
        except KeyError:
            raise HFError(f"{hf_dir}: unexpected tensor {key!r} (no Llama parameter has that name)") from None
    if check:
        _check_state(state, cfg, hf_key, str(hf_dir))
    return state


def _our_name(hf_name: str) -> str:
    try:
        return from_hf_key(hf_name)
    except KeyError:
        return hf_name  # reported (or ignored) by the caller with the full context


@torch.no_grad()
def init_from_hf(model: nn.Module, hf_dir: str | Path, cfg: ModelConfig | None = None,
                 read: Callable[[str, Any], Tensor] | None = None) -> None:
    """Load ``hf_dir`` into ``model`` (strict) after checking its shape equals ``cfg`` (default
    ``model.cfg``); ``read`` selects this rank's part of each tensor (see load_hf_state_dict)."""
    cfg = cfg or model.cfg
    check_same_shape(model_config_from_hf(hf_dir), cfg, str(hf_dir))
    model.load_state_dict(load_hf_state_dict(hf_dir, cfg, read), strict=True)


def save_hf(model_state: dict[str, Tensor], cfg: ModelConfig, out_dir: str | Path, overwrite: bool = False,
            tokenizer: Any = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (fp32, HF names) that
    ``LlamaForCausalLM.from_pretrained(out_dir)`` loads, and with ``tokenizer`` (an object with
    ``export_hf(directory, model_max_length)``, e.g. a hybridpar.data tokenizer) the files that
    ``AutoTokenizer.from_pretrained(out_dir)`` loads. Atomic: built in a temporary sibling
    directory, then renamed; an existing non-empty ``out_dir`` is replaced only with ``overwrite``.
    Published with the modes a plain mkdir/open would give (the safetensors writer's are 0600)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{str(out)!r} exists and is not empty; choose a new directory or pass --overwrite")
    state = {k: v.detach() for k, v in model_state.items()}
    _check_state(state, cfg, lambda k: k, "model state")
    tensors = {hf_key(k): v.to("cpu", torch.float32).contiguous() for k, v in state.items()}
    hf_cfg = {**to_hf_config_dict(cfg), "architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "torch_dtype": "float32", "dtype": "float32"}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        (tmp / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.export_hf(tmp, model_max_length=cfg.max_seq_len)
        publish_modes(tmp)
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        elif old.exists():
            old.unlink()
    return out


def _convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridpar convert",
                                description="Export a hybridpar checkpoint as Hugging Face LlamaForCausalLM weights.")
    p.add_argument("checkpoint", help="a hybridpar checkpoint directory")
    p.add_argument("--to-hf", required=True, metavar="DIR",
                   help="output directory (config.json + model.safetensors + the tokenizer's tokenizer.json)")
    p.add_argument("--overwrite", action="store_true", help="replace DIR if it exists and is not empty")
    return p


def cmd_convert(argv: list[str]) -> int:
    """``hybridpar convert CHECKPOINT --to-hf DIR [--overwrite]``."""
    args = _convert_parser().parse_args(argv)
    from hybridpar.training.checkpoint import load_model_state, load_tokenizer_of

    if not Path(args.checkpoint).is_dir():
        raise ConfigError(f"checkpoint {args.checkpoint!r} is not a directory; pass a hybridpar checkpoint directory")
    try:
        cfg, state = load_model_state(args.checkpoint)
        tokenizer = load_tokenizer_of(args.checkpoint)
        out = save_hf(state, cfg.model, args.to_hf, overwrite=args.overwrite, tokenizer=tokenizer)
    except FileExistsError as e:
        raise ConfigError(str(e)) from None
    print(f"hybridpar: wrote {cfg.model.num_params() / 1e6:.2f}M parameters as Hugging Face Llama to {out}, "
          f"with its {tokenizer.kind} tokenizer (vocab {tokenizer.vocab_size})")
    return 0
