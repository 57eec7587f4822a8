"""Hugging Face weights in and out, for every family: ``config.json`` + safetensors.

``config.json``'s ``model_type`` picks the family (:mod:`hybridpar.models.registry`) and the
family's :class:`~hybridpar.models.family.HFMapping` translates the config and the tensor names.
Reading goes through the ``safetensors`` library only (never ``torch.load``/pickle), from
``model.safetensors`` or a sharded ``model.safetensors.index.json``; anything a family cannot
represent exactly (RoPE scaling, another activation) is rejected with one message naming the key
and value.
"""

from __future__ import annotations

import contextlib
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

from hybridpar.config import ModelConfig
from hybridpar.fsutil import publish_modes
from hybridpar.models.family import Family, HFError
from hybridpar.models.lazy import shape_of
from hybridpar.models.registry import FAMILIES, family_of

__all__ = ["HFError", "check_same_shape", "init_from_hf", "load_hf_state_dict",
           "model_config_from_hf", "save_hf"]

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"
HEAD = "lm_head.weight"  # every Hugging Face causal LM's output head
# Keys some checkpoints carry that hold no parameters of the model (old RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_config(hf_dir: str | Path) -> dict[str, Any]:
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise HFError(f"{str(path)!r} does not exist; point at a Hugging Face model directory "
                      "(config.json + model.safetensors)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFError(f"{str(path)!r} is not valid JSON: {e}") from None


def _unscaled_rope(c: dict[str, Any]) -> dict[str, Any]:
    """``c`` with a RoPE scaling the models do not implement read as unscaled (the planner's view:
    memory and time do not depend on the rotation)."""
    from hybridpar.models.rope import ROPE_TYPES

    out = dict(c)
    for key in ("rope_parameters", "rope_scaling"):
        p = c.get(key)
        if isinstance(p, dict) and p.get("rope_type", p.get("type")) not in (None, *ROPE_TYPES):
            out[key] = {k: v for k, v in p.items() if k == "rope_theta"} | {"rope_type": "default"}
    return out


def model_config_from_hf(hf_dir: str | Path, *, any_rope: bool = False) -> ModelConfig:
    """The :class:`ModelConfig` (family and shape) of the model in ``hf_dir/config.json``;
    rejects what its family cannot represent exactly, naming the key and value. ``any_rope``
    (the planner): a RoPE type the model does not implement is read as unscaled."""
    if (Path(hf_dir) / "complete.json").is_file():  # has a config.json too, but hybridpar's own
        raise HFError(f"{str(hf_dir)!r} is a hybridpar checkpoint, not a Hugging Face model directory: continue "
                      f"training from it with --resume {hf_dir}, or export it with "
                      f"`hybridpar convert {hf_dir} --to-hf DIR` and start from DIR")
    c = _read_config(hf_dir)
    c = _unscaled_rope(c) if any_rope else c
    where = str(Path(hf_dir) / "config.json")
    model_type = c.get("model_type")
    if model_type not in FAMILIES:
        raise HFError(f"{where}: model_type = {json.dumps(model_type)} is not supported; supported: "
                      f"{', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type].hf.config_from_hf(c, where, Path(hf_dir).name)


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
        # parameters and persistent buffers (an MoE router's balancing bias, DeepSeek-V3's is stored)
        return {name: t.shape for name, t in family_of(cfg).build(cfg).state_dict().items()}


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
    _load(hf_dir, cfg, lambda name, sl: torch.empty(shape_of(sl), device="meta"), check=True)  # no data read
    return _load(hf_dir, cfg, read, check=False)


def _load(hf_dir: Path, cfg: ModelConfig, read: Callable[[str, Any], Tensor], check: bool) -> dict[str, Tensor]:
    family = family_of(cfg)
    with contextlib.ExitStack() as files:
        lazy: dict[str, Any] = {}
        for fname, keys in _tensor_files(hf_dir).items():
            if not (hf_dir / fname).is_file():
                raise HFError(f"{str(hf_dir / fname)!r} is listed in {INDEX} but does not exist")
            f = files.enter_context(safe_open(str(hf_dir / fname), framework="pt"))
            present = set(f.keys())
            for key in keys or sorted(present):
                if key not in present:
                    raise HFError(f"{hf_dir / INDEX} maps {key!r} to {fname}, which lacks it")
                if not key.endswith(_IGNORED_SUFFIXES):
                    lazy[key] = f.get_slice(key)
        _drop_tied_head(lazy, cfg, family, hf_dir)
        expected = _expected_shapes(cfg)
        state, shown = {}, _hf_name(family)
        for name, value in family.hf.to_ours(lazy):
            if name not in expected:
                raise HFError(f"{hf_dir}: unexpected tensor {shown(name)!r} (no {family.name} parameter of this "
                              "config has that name)")
            state[name] = read(name, value)
    if check:
        _check_state(state, cfg, shown, str(hf_dir))
    return state


def _drop_tied_head(lazy: dict[str, Any], cfg: ModelConfig, family: Family, hf_dir: Path) -> None:
    """With tied embeddings an ``lm_head.weight`` may be stored; it must equal the embedding."""
    head = lazy.get(HEAD)
    if not cfg.tie_embeddings or head is None:
        return
    embed = lazy.get(family.hf.hf_key("tok_embeddings.weight"))
    if embed is None or shape_of(embed) != shape_of(head) or not torch.equal(embed[:], head[:]):
        raise HFError(f"{hf_dir}: tie_word_embeddings is true but {HEAD} differs from the embedding")
    del lazy[HEAD]


def _hf_name(family: Family) -> Callable[[str], str]:
    def name(ours: str) -> str:
        try:
            return family.hf.hf_key(ours)
        except KeyError:
            return ours
    return name


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
    """Write ``config.json`` + ``model.safetensors`` (fp32, HF names) that the family's
    ``*ForCausalLM.from_pretrained(out_dir)`` loads, and with ``tokenizer`` (an object with
    ``export_hf(directory, model_max_length)``, e.g. a hybridpar.data tokenizer) the files that
    ``AutoTokenizer.from_pretrained(out_dir)`` loads. Atomic: built in a temporary sibling
    directory, then renamed; an existing non-empty ``out_dir`` is replaced only with ``overwrite``.
    Published with the modes a plain mkdir/open would give (the safetensors writer's are 0600)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(f"{str(out)!r} exists and is not empty; choose a new directory or pass --overwrite")
    hf = family_of(cfg).hf
    # first: the config may hold what the format cannot say (e.g. an MoE balancing bias)
    hf_cfg = {**hf.to_hf_config(cfg), "torch_dtype": "float32", "dtype": "float32"}
    state = {k: v.detach() for k, v in model_state.items()}
    _check_state(state, cfg, lambda k: k, "model state")
    tensors = {k: v.to("cpu", torch.float32).contiguous() for k, v in hf.to_hf(state).items()}
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
