"""What a checkpoint holds and how it comes back: the model and optimizer pieces this rank holds
(DTensor pieces of the full tensors, keyed by parameter name, so a later layout can reshard
them), the RNG and the caller's ``extra``, plus the run's config and tokenizer. :func:`save`
hands them to the atomic writer (:mod:`.writer`), directly or through a
:class:`~.background.BackgroundWriter`; :func:`load` restores them under any layout.

Nothing here unpickles untrusted data: tensors load with ``weights_only``, and DCP's pickled
metadata goes through the allow-list unpickler (:class:`~.safe_metadata.SafeReader`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from hybridpar.config import Config
from hybridpar.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, save_tokenizer
from hybridpar.distributed.mesh import Topology
from hybridpar.models.registry import family_of
from hybridpar.parallel.zero import DataParallelOptimizer
from hybridpar.training.checkpoint.background import BackgroundWriter
from hybridpar.training.checkpoint.durable import causes, reason, write_durable
from hybridpar.training.checkpoint.manifest import read_config, read_info
from hybridpar.training.checkpoint.paths import require_complete
from hybridpar.training.checkpoint.safe_metadata import CheckpointError, SafeReader
from hybridpar.training.checkpoint.writer import (
    process_group,
    single_process_quiet,
    write_checkpoint,
)

TOKENIZER_INFO = "tokenizer-info.json"


def save(path: Path, model: nn.Module, optimizer: DataParallelOptimizer, cfg: Config, step: int,
         topo: Topology, tokenizer: Tokenizer | None = None, extra: dict[str, Any] | None = None,
         writer: BackgroundWriter | None = None) -> Path:
    """Write a complete checkpoint for ``step`` at ``path`` atomically (all ranks call this):
    the model and optimizer pieces this rank holds, the run's config and its tokenizer (so
    ``generate`` and ``convert`` need no dataset). See :func:`write_checkpoint`. With
    ``train.keep_checkpoints = K > 0`` the older complete checkpoints beyond the newest K are
    deleted once this one is complete. With a ``writer`` (``async_checkpoint.enabled``) the
    writer's thread copies the state to host memory (leave it unchanged until
    :meth:`BackgroundWriter.hold` returns) and writes the copy while training goes on: ``path``
    is complete only once :meth:`BackgroundWriter.wait` (or a later ``poll``) returns."""
    def files(tmp: Path) -> None:
        write_durable(tmp / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)

    state = train_state(model, optimizer, extra)
    keep = cfg.train.keep_checkpoints
    if writer is None:
        return write_checkpoint(path, state, topo, step, files, keep=keep)
    return writer.submit(path, state, lambda staged, axis: write_checkpoint(path, staged, topo, step, files,
                                                                            keep=keep, axis=axis))


def load(path: Path, model: nn.Module, optimizer: DataParallelOptimizer, cfg: Config, topo: Topology,
         extra: dict[str, Any] | None = None) -> int:
    """Restore model, optimizer, RNG and ``extra`` (filled in place: pass the same structure
    that was saved) from a complete checkpoint; returns its step."""
    path = Path(path)
    info = read_info(require_complete(path))
    saved = read_config(path)
    check_compatible(saved, cfg, path)
    state = train_state(model, optimizer, extra, same_layout=saved.parallel == cfg.parallel)
    own_names = [list(group["params"]) for group in state["optim"]["param_groups"]]
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=SafeReader(str(path)), process_group=process_group(topo.world),
                     no_dist=topo.world_size == 1)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # DCP wraps per-rank failures; say which checkpoint and why
        raise _load_error(path, e, "") from None
    _keep_own_group_names(state["optim"], own_names, path)
    optimizer.load_checkpoint_state(model, state)
    torch.set_rng_state(state["rng"]["torch_cpu"])
    return int(info["step"])


def _load_error(path: Path, e: BaseException, hint: str) -> CheckpointError:
    """One line for a failed ``dcp.load`` (DCP's CheckpointException carries a traceback per rank)."""
    inner = next((x for x in causes(e) if isinstance(x, CheckpointError)), None)
    if inner is not None:
        return CheckpointError(str(inner))
    return CheckpointError(f"checkpoint {path} could not be loaded: {reason(e)}{hint}")


def load_model_state(path: str | Path) -> tuple[Config, dict[str, torch.Tensor]]:
    """The run's Config and the full model state (our naming) of a checkpoint, in one process."""
    path = Path(path)
    cfg = read_config(require_complete(path))
    model = family_of(cfg.model).build(cfg.model)
    state = {"model": get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))}
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=SafeReader(str(path)), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:
        raise _load_error(path, e, "; its config.json may not describe its weights (was it edited?)") from None
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


def train_state(model: nn.Module, optimizer: DataParallelOptimizer, extra: dict[str, Any] | None,
                 same_layout: bool = True) -> dict[str, Any]:
    """What a checkpoint holds, keyed by parameter name: the parameters this rank trains (all
    of them, or one pipeline stage's), the model's buffers and their optimizer state, as DTensor
    pieces of the full tensors where tp or ZeRO split them, so DCP stores each piece once and
    any other layout reads the pieces it needs (every ZeRO stage, 0 included, is one path).
    ``same_layout``: a load template for a checkpoint of this very layout (the optimizer then
    includes its per-rank state)."""
    return {**optimizer.checkpoint_state(model, same_layout), "rng": {"torch_cpu": torch.get_rng_state()},
            "extra": extra if extra is not None else {}}


def _keep_own_group_names(optim_sd: dict[str, Any], own_names: list[list[str]], path: Path) -> None:
    """Param groups are plain objects, so DCP stores one rank's copy, and its ``params`` name
    only the parameters that rank trained (one pipeline stage's, under pp): keep the saved
    hyper-parameters of each group, but this rank's own parameter names."""
    saved = optim_sd["param_groups"]
    if len(saved) != len(own_names):
        raise CheckpointError(f"checkpoint {path} has {len(saved)} optimizer parameter groups, this run has "
                              f"{len(own_names)}; it was saved by another optimizer setup")
    optim_sd["param_groups"] = [{**group, "params": names} for group, names in zip(saved, own_names, strict=True)]
