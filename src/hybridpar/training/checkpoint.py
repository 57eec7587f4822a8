"""Checkpoints: model + optimizer through ``torch.distributed.checkpoint`` (so a later layout can
reshard them), plus the run's config and position as plain JSON.

Layout of ``<run_dir>/checkpoints/step-000010/``: DCP's ``.distcp`` shards and ``.metadata``,
``config.json``, and ``complete.json`` written last. Everything is written into a temporary
sibling first and renamed once every rank has finished, so a directory named ``step-*`` with a
``complete.json`` is always whole; anything else is ignored by ``--resume``.

Nothing here unpickles untrusted data: tensors load with ``weights_only``, and DCP's pickled
metadata goes through an allow-list unpickler (:class:`SafeReader`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from hybridpar.config import Config, ConfigError, config_from_dict
from hybridpar.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, save_tokenizer
from hybridpar.distributed.mesh import Topology
from hybridpar.errors import UserError
from hybridpar.parallel.tensor_plan import shard_dim
from hybridpar.parallel.zero import ZeroOptimizer
from hybridpar.training.metrics import atomic_write_text

COMPLETE = "complete.json"
TOKENIZER_INFO = "tokenizer-info.json"
CKPT_DIR = "checkpoints"
FORMAT = 1


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete, corrupt or does not fit this run."""


# ----------------------------------------------------------------------------- safe metadata

_ALLOWED_MODULE_PREFIXES = ("torch.distributed.checkpoint.",)
_ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "getattr"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),  # maps "torch.strided" to the layout object
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}


class _AllowListUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata but refuses any global outside DCP's own dataclasses and a few
    torch value types, so a crafted ``.metadata`` cannot run code."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_ALLOWED_MODULE_PREFIXES) or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata is read with the allow-list unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:  # noqa: D102
        path = Path(self.path) / (".metadata" if kwargs.get("rank") is None else f"__{kwargs['rank']}.metadata")
        try:
            with open(path, "rb") as f:
                metadata = _AllowListUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
            raise CheckpointError(f"checkpoint metadata {path} is corrupt or unsafe: {e}") from None
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# ----------------------------------------------------------------------------- paths


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CKPT_DIR / f"step-{step:06d}"


def is_complete(path: Path) -> bool:
    return (Path(path) / COMPLETE).is_file()


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete ``step-*`` checkpoint under ``run_dir``, or None."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step-*") if p.is_dir() and is_complete(p))
    return done[-1] if done else None


def resolve_resume(resume: str, run_dir: Path) -> Path:
    """``--resume`` with no value (``"latest"``) or a path -> a complete checkpoint directory."""
    if resume == "latest":
        found = latest_checkpoint(run_dir)
        if found is None:
            raise CheckpointError(f"--resume: no complete checkpoint under {Path(run_dir) / CKPT_DIR}; "
                                  "start without --resume or pass a checkpoint path")
        return found
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume}: no such checkpoint directory")
    if not is_complete(path):
        raise CheckpointError(f"--resume {resume}: checkpoint is incomplete (no {COMPLETE}); "
                              "it was interrupted while saving — pick an earlier one")
    return path


def read_info(path: Path) -> dict[str, Any]:
    """The completion record (step, format, time) of a complete checkpoint."""
    try:
        return json.loads((Path(path) / COMPLETE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable {COMPLETE} ({e})") from None


def read_config(path: Path) -> Config:
    try:
        return config_from_dict(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable config.json ({e})") from None
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {path}: config.json is invalid: {e}") from None


# ----------------------------------------------------------------------------- save / load


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | ZeroOptimizer, cfg: Config, step: int,
         topo: Topology, tokenizer: Tokenizer | None = None, extra: dict[str, Any] | None = None) -> Path:
    """Write a complete checkpoint for ``step`` at ``path`` atomically (all ranks call this).
    The tokenizer travels with it, so ``generate`` and ``convert`` need no dataset."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    if topo.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    topo.comm.barrier()
    state = _train_state(model, optimizer, topo, extra)
    with single_process_quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), process_group=_group(topo),
                 no_dist=topo.world_size == 1)
    topo.comm.barrier()
    if topo.rank == 0:
        atomic_write_text(tmp / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)
        atomic_write_text(tmp / COMPLETE, json.dumps({"step": step, "format": FORMAT, "time": time.time(),
                                                      "world_size": topo.world_size,
                                                      "files": _manifest(tmp)}, indent=1) + "\n")
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    topo.comm.barrier()
    return path


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | ZeroOptimizer, cfg: Config, topo: Topology,
         extra: dict[str, Any] | None = None) -> int:
    """Restore model, optimizer, RNG and ``extra`` (filled in place: pass the same structure
    that was saved) from a complete checkpoint; returns its step."""
    path = Path(path)
    info = read_info(require_complete(path))
    check_compatible(read_config(path), cfg, path)
    state = _train_state(model, optimizer, topo, extra)
    own_names = [list(group["params"]) for group in state["optim"]["param_groups"]]
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=SafeReader(str(path)), process_group=_group(topo),
                     no_dist=topo.world_size == 1)
    except CheckpointError:
        raise
    except Exception as e:  # DCP wraps per-rank failures; say which checkpoint and why
        raise CheckpointError(f"checkpoint {path} could not be loaded: {str(e).splitlines()[0][:300]}") from e
    _keep_own_group_names(state["optim"], own_names, path)
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.load_checkpoint_state(model, state)
    else:
        state = _local(state)
        # A pipeline stage's state names only its own parameters (DCP has checked that the
        # checkpoint holds every one of them): the other stages' parameters are not missing.
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=False))
    torch.set_rng_state(state["rng"]["torch_cpu"])
    return int(info["step"])


def load_model_state(path: str | Path) -> tuple[Config, dict[str, torch.Tensor]]:
    """The run's Config and the full model state (our naming) of a checkpoint, in one process."""
    from hybridpar.models.llama import Llama

    path = Path(path)
    cfg = read_config(require_complete(path))
    model = Llama(cfg.model)
    state = {"model": get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))}
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=SafeReader(str(path)), no_dist=True)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"checkpoint {path} could not be loaded: {str(e).splitlines()[0][:300]}") from e
    return cfg, state["model"]


def load_tokenizer_of(path: str | Path) -> Tokenizer:
    """The tokenizer saved with a checkpoint (byte-level for checkpoints saved without one)."""
    info_path = Path(path) / TOKENIZER_INFO
    if not info_path.is_file():
        return ByteTokenizer()
    return load_tokenizer(json.loads(info_path.read_text()), Path(path))


def check_compatible(saved: Config, cfg: Config, path: Path) -> None:
    """A checkpoint resumes only into the same model shape; name every differing field."""
    diffs = [f"model.{k}: checkpoint {v!r} vs run {getattr(cfg.model, k)!r}"
             for k, v in vars(saved.model).items() if k != "preset" and getattr(cfg.model, k) != v]
    if diffs:
        raise CheckpointError(f"checkpoint {path} has another model shape ({'; '.join(diffs)}); "
                              "set the run's model.* to match or start a new run")


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that a single-process save/load is single-process (it is meant)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def _train_state(model: nn.Module, optimizer: torch.optim.Optimizer | ZeroOptimizer, topo: Topology,
                 extra: dict[str, Any] | None) -> dict[str, Any]:
    """What a checkpoint holds, keyed by parameter name: the parameters this rank trains (all
    of them, or one pipeline stage's) and their optimizer state. Tensor-parallel shards (and their
    optimizer moments) become DTensors over the tp mesh axis, so DCP stores each shard once as
    a piece of the full tensor and any other layout can read the pieces it needs."""
    if isinstance(optimizer, ZeroOptimizer):  # each dp rank holds (and writes) its shards
        return {**optimizer.checkpoint_state(model), "rng": {"torch_cpu": torch.get_rng_state()},
                "extra": extra if extra is not None else {}}
    _ensure_optimizer_state(optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # a pipeline stage holds (and saves) only the parameters its optimizer trains
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    keep = {name for name, p in model.named_parameters() if id(p) in trained}
    model_sd = {k: v for k, v in model_sd.items() if k in keep}
    if topo.tp.size > 1:
        mesh = topo.mesh["tp"]

        def wrap(name: str, t: torch.Tensor) -> torch.Tensor:
            dim = shard_dim(name)
            if dim is None or not isinstance(t, torch.Tensor) or t.dim() == 0:
                return t
            return DTensor.from_local(t, mesh, [Shard(dim)], run_check=False)

        model_sd = {k: wrap(k, v) for k, v in model_sd.items()}
        optim_sd["state"] = {k: {n: wrap(k, t) for n, t in st.items()} for k, st in optim_sd["state"].items()}
    return {"model": model_sd, "optim": optim_sd, "rng": {"torch_cpu": torch.get_rng_state()},
            "extra": extra if extra is not None else {}}


@torch.no_grad()
def _ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state (zeros, by one step at lr 0) if it has none
    yet, so a fresh run's state dict names every entry for ``dcp.load`` to fill in.

    torch's ``get_state_dict`` would do this itself, but only when no parameter has a ``.grad``,
    and under data parallelism every ``.grad`` is already a view into the reducer's buckets:
    it would then skip the step, the template would hold no optimizer state and the load would
    silently restart Adam's moments. Here the bucket views are set aside and put back."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p, g in zip(params, grads, strict=True):
            p.grad = g


def _keep_own_group_names(optim_sd: dict[str, Any], own_names: list[list[str]], path: Path) -> None:
    """Param groups are plain objects, so DCP stores one rank's copy, and its ``params`` name
    only the parameters that rank trained (one pipeline stage's, under pp): keep the saved
    hyper-parameters of each group, but this rank's own parameter names."""
    saved = optim_sd["param_groups"]
    if len(saved) != len(own_names):
        raise CheckpointError(f"checkpoint {path} has {len(saved)} optimizer parameter groups, this run has "
                              f"{len(own_names)}; it was saved by another optimizer setup")
    optim_sd["param_groups"] = [{**group, "params": names} for group, names in zip(saved, own_names, strict=True)]


def _local(tree: Any) -> Any:
    """The same nested state with every DTensor replaced by this rank's local shard."""
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_local(v) for v in tree]
    return tree


def require_complete(path: Path) -> Path:
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not is_complete(path):
        raise CheckpointError(f"checkpoint {path} is incomplete (no {COMPLETE}); it was interrupted while saving")
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"checkpoint {path} has no .metadata; it is not a complete hybridpar checkpoint")
    SafeReader(str(path)).read_metadata()  # refuse unsafe or corrupt metadata before DCP wraps the error
    expected = read_info(path).get("files", {})
    for name, entry in expected.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}; it was damaged after saving")
        if f.stat().st_size != entry["bytes"] or _sha256(f) != entry["sha256"]:
            raise CheckpointError(f"checkpoint file {f} does not match its checksum in {COMPLETE} "
                                  f"({f.stat().st_size} bytes, expected {entry['bytes']}); it is corrupt — "
                                  "resume from an earlier checkpoint")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every data file DCP wrote, checked before each load."""
    return {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)}
            for f in sorted(folder.iterdir()) if f.suffix == ".distcp" or f.name == ".metadata"}


def _group(topo: Topology) -> Any:
    """The process group spanning every rank (None in a single process: DCP then needs none)."""
    return topo.world.group if topo.world_size > 1 else None
