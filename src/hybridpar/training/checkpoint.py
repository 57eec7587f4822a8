"""Checkpoints: model + optimizer through ``torch.distributed.checkpoint`` (so a later layout can
reshard them), plus the run's config and position as plain JSON.

Layout of ``<run_dir>/checkpoints/step-000010/``: DCP's ``.distcp`` shards and ``.metadata``,
``config.json``, the tokenizer files, and ``complete.json`` written last with the size and
sha256 of every other file. Everything is written into ``.tmp-step-000010`` first, fsynced, and
renamed once every rank has finished, so a directory named ``step-*`` with a ``complete.json``
is always whole; anything else is ignored by ``--resume``. Re-saving an existing step moves the
old directory aside (``.old-step-N``) before the new one is renamed in; a crash in between
leaves the old one to be restored (:func:`recover`). Deleted checkpoints are first renamed to
``.del-step-N``, so a half-deleted one is never mistaken for a checkpoint.

Nothing here unpickles untrusted data: tensors load with ``weights_only``, and DCP's pickled
metadata goes through an allow-list unpickler (:class:`SafeReader`, in ``safe_metadata.py``).
fsync, free space and disk-full detection live in ``durable.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
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
from torch.distributed.tensor import DTensor

from hybridpar.config import Config, ConfigError, config_from_dict
from hybridpar.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, save_tokenizer
from hybridpar.distributed.lifecycle import says_job_notices
from hybridpar.distributed.mesh import Axis, Topology
from hybridpar.errors import agreed
from hybridpar.fsutil import dir_mode, publish_modes
from hybridpar.models.registry import family_of
from hybridpar.parallel.zero import ZeroOptimizer
from hybridpar.training.background import BackgroundWriter
from hybridpar.training.durable import (
    _causes,
    _disk_full,
    _free_bytes,
    _fsync_dir,
    _fsync_file,
    _reason,
    _root_cause,
    _sha256,
    _size,
    _write_durable,
)
from hybridpar.training.safe_metadata import CheckpointError, SafeReader

COMPLETE = "complete.json"
TOKENIZER_INFO = "tokenizer-info.json"
CKPT_DIR = "checkpoints"
FORMAT = 1


# ----------------------------------------------------------------------------- paths

TMP, OLD, DEL = ".tmp-", ".old-", ".del-"  # prefixes of a save in progress, a replaced step, a deletion


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CKPT_DIR / f"step-{step:06d}"


def is_complete(path: Path) -> bool:
    return (Path(path) / COMPLETE).is_file()


def _step_of(path: Path) -> int | None:
    """N of a directory named ``step-N``, else None."""
    name = Path(path).name
    digits = name[len("step-"):]
    return int(digits) if name.startswith("step-") and digits.isdigit() else None


def _candidates(root: Path) -> list[Path]:
    """The ``step-N`` directories under ``root`` that have a ``complete.json``, newest first."""
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if (s := _step_of(p)) is not None and p.is_dir() and is_complete(p)]
    return [p for _, p in sorted(found, reverse=True)]


def _problem(path: Path, deep: bool) -> str | None:
    """Why ``path`` is not a whole checkpoint, as the rest of a sentence that starts with
    "checkpoint " (None: it is whole): a valid ``complete.json``, the metadata, and every file of
    its manifest at its size; ``deep`` also reads the metadata through the safe unpickler and
    compares every checksum."""
    if not path.is_dir():
        return f"{path} does not exist"
    if not is_complete(path):
        return f"{path} is incomplete (no {COMPLETE}); it was interrupted while saving"
    info, why = _info(path)
    if why is not None:
        return why
    if not (path / ".metadata").is_file():
        return f"{path} has no .metadata; it is not a complete hybridpar checkpoint"
    if deep:
        try:
            SafeReader(str(path)).read_metadata()  # refuse unsafe or corrupt metadata before DCP wraps the error
        except CheckpointError as e:
            return str(e).removeprefix("checkpoint ")
    for name, entry in info.get("files", {}).items():
        f = path / name
        if not f.is_file():
            return f"{path} is missing {name}; it was damaged after saving"
        size = f.stat().st_size
        if size != entry["bytes"] or (deep and _sha256(f) != entry["sha256"]):
            return (f"file {f} does not match its checksum in {COMPLETE} ({size} bytes, expected "
                    f"{entry['bytes']}); it is corrupt")
    return None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest whole ``step-*`` checkpoint under ``run_dir`` (a valid ``complete.json`` and
    every file it lists, at its size; checksums are not read), or None. Leftovers of an
    interrupted save (``.tmp-*``, ``.old-*``, ``.del-*``) are never picked."""
    return next((p for p in _candidates(Path(run_dir) / CKPT_DIR) if _problem(p, deep=False) is None), None)


def latest_verified_checkpoint(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under ``run_dir`` that passes :func:`require_complete` (every
    checksum), and the newer ones skipped on the way, each with the reason."""
    skipped: list[tuple[Path, str]] = []
    for p in _candidates(Path(run_dir) / CKPT_DIR):
        why = _problem(p, deep=True)
        if why is None:
            return p, skipped
        skipped.append((p, why))
    return None, skipped


def _earlier(path: Path) -> Path | None:
    """The newest verified checkpoint beside ``path`` with a lower step (for error messages)."""
    step = _step_of(path)
    for p in _candidates(Path(path).parent):
        if p != path and (step is None or (_step_of(p) or 0) < step) and _problem(p, deep=True) is None:
            return p
    return None


def recover(run_dir: Path) -> None:
    """Finish what a crash interrupted under ``run_dir/checkpoints``: an ``.old-step-N`` (moved
    aside to re-save step N) is put back when no whole ``step-N`` replaced it, and removed when
    one did; ``.del-*`` (checkpoints being deleted) are removed. Safe to run on several ranks at
    once (each step is a rename that at most one wins); not while a save is running."""
    _recover_dir(Path(run_dir) / CKPT_DIR)


def _recover_dir(root: Path) -> None:
    if not root.is_dir():
        return
    for p in sorted(root.iterdir()):
        if p.name.startswith(DEL):
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(OLD) and _step_of(Path(p.name[len(OLD):])) is not None:
            target = root / p.name[len(OLD):]
            if target.exists() and _problem(target, deep=False) is None:
                _remove(p)
            elif not target.exists() and _problem(p, deep=False) is None:
                with contextlib.suppress(OSError):
                    os.rename(p, target)
                    _fsync_dir(root)
            elif not target.exists():
                _remove(p)


def _remove(path: Path) -> None:
    """Delete a checkpoint directory so that no crash leaves a half-deleted one that looks
    whole: rename it to ``.del-<name>`` first (atomic), then delete that."""
    doomed = path.with_name(DEL + path.name.removeprefix(OLD))
    try:
        shutil.rmtree(doomed, ignore_errors=True)
        os.rename(path, doomed)
    except OSError:  # gone already (another rank), or not ours to rename: leave it
        return
    shutil.rmtree(doomed, ignore_errors=True)


def resolve_resume(resume: str, run_dir: Path) -> Path:
    """``--resume`` with no value (``"latest"``) or a path -> a complete checkpoint directory.
    ``latest`` skips checkpoints that fail their checksums, saying so on rank 0."""
    if resume == "latest":
        recover(run_dir)
        found, skipped = latest_verified_checkpoint(run_dir)
        if says_job_notices():  # once: the launcher's check, or rank 0 of another launcher's job
            for _, why in skipped:
                print(f"hybridpar: warning: skipping checkpoint {why}", file=sys.stderr, flush=True)
        if found is None:
            why = f" (newest: checkpoint {skipped[0][1]})" if skipped else ""
            raise CheckpointError(f"--resume: no complete checkpoint under {Path(run_dir) / CKPT_DIR}{why}; "
                                  "start without --resume or pass a checkpoint path")
        return found
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"--resume {resume}: no such checkpoint directory")
    if not is_complete(path):
        raise CheckpointError(f"--resume {resume}: {_not_a_checkpoint(path, resume=True)}")
    why = _problem(path, deep=False)
    if why is not None:
        raise CheckpointError(f"--resume {resume}: checkpoint {why}{_use_earlier(path)}")
    return path


def _not_a_checkpoint(path: Path, resume: bool) -> str:
    """What a directory without ``complete.json`` is, and what to pass instead."""
    if (path / CKPT_DIR).is_dir():
        latest = latest_checkpoint(path)
        example = latest if latest is not None else f"{path / CKPT_DIR}/step-N"
        if resume:
            return (f"is a run directory, not a checkpoint; use --resume (latest) with --train.run_dir {path}, "
                    f"or --resume {example}")
        return f"is a run directory, not a checkpoint; pass one of its checkpoints, e.g. {example}"
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        if resume:
            return f"is a Hugging Face model directory, not a checkpoint; use --train.init_from {path}"
        return f"is a Hugging Face model directory, not a hybridpar checkpoint; train from it with --train.init_from {path}"
    if (path / "meta.json").is_file() and any(path.glob("*.bin")):  # hybridpar.data's prepared dataset
        return (f"is a prepared dataset, not a checkpoint; train on it with --train.data {path}"
                + (" (--resume takes a checkpoint directory or a run directory)" if resume else ""))
    return f"checkpoint is incomplete (no {COMPLETE}); it was interrupted while saving — pick an earlier one"


def _use_earlier(path: Path) -> str:
    earlier = _earlier(path)
    if earlier is None:
        return f" — there is no earlier complete checkpoint in {path.parent}"
    return f" — resume from the earlier complete checkpoint {earlier} (--resume {earlier})"


def _info_problem(info: Any) -> str | None:
    """What is wrong with a parsed ``complete.json`` (None: nothing)."""
    if not isinstance(info, dict):
        return "is not a JSON object"
    if "step" not in info:
        return "has no 'step'"
    step = info["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"has step = {json.dumps(step)}, not a step number >= 0"
    if "format" in info and info["format"] != FORMAT:
        return f"has format = {json.dumps(info['format'])}; this hybridpar reads format {FORMAT}"
    files = info.get("files", {})
    if not isinstance(files, dict):
        return "has a 'files' manifest that is not an object"
    for name, entry in files.items():
        ok = (isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)
              and name not in ("", ".", "..") and "/" not in name and "\\" not in name)
        if not ok:
            return f"has a malformed 'files' entry {json.dumps(name)}"
    return None


def _info(path: Path) -> tuple[dict[str, Any], str | None]:
    """``complete.json`` of ``path`` and, if it is unusable, why (a "checkpoint ..." sentence tail)."""
    try:
        info = json.loads((Path(path) / COMPLETE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        return {}, f"{path}: unreadable {COMPLETE} ({e})"
    why = _info_problem(info)
    if why is not None:
        return {}, f"{path}: {COMPLETE} {why}; it was not written by hybridpar or was edited"
    return info, None


def read_info(path: Path) -> dict[str, Any]:
    """The completion record (step, format, time, manifest) of a complete checkpoint, checked
    field by field before anything is loaded."""
    info, why = _info(path)
    if why is not None:
        raise CheckpointError(f"checkpoint {why}")
    return info


def read_config(path: Path) -> Config:
    try:
        return config_from_dict(json.loads((Path(path) / "config.json").read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable config.json ({e})") from None
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {path}: config.json is invalid: {e}") from None


# ----------------------------------------------------------------------------- save / load

_SMALL_FILES = 1 << 20  # room for .metadata, config.json and the tokenizer on top of the tensors


def save(path: Path, model: nn.Module, optimizer: ZeroOptimizer, cfg: Config, step: int,
         topo: Topology, tokenizer: Tokenizer | None = None, extra: dict[str, Any] | None = None,
         writer: BackgroundWriter | None = None) -> Path:
    """Write a complete checkpoint for ``step`` at ``path`` atomically (all ranks call this):
    the model and optimizer pieces this rank holds, the run's config and its tokenizer (so
    ``generate`` and ``convert`` need no dataset). See :func:`write_checkpoint`. With
    ``train.keep_checkpoints = K > 0`` the older complete checkpoints beyond the newest K are
    deleted once this one is complete. With a ``writer`` (``train.async_checkpoint``) the
    writer's thread copies the state to host memory (leave it unchanged until
    :meth:`BackgroundWriter.hold` returns) and writes the copy while training goes on: ``path``
    is complete only once :meth:`BackgroundWriter.wait` (or a later ``poll``) returns."""
    def files(tmp: Path) -> None:
        _write_durable(tmp / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
        if tokenizer is not None:
            save_tokenizer(tokenizer, tmp)

    state = _train_state(model, optimizer, extra)
    keep = cfg.train.keep_checkpoints
    if writer is None:
        return write_checkpoint(path, state, topo, step, files, keep=keep)
    return writer.submit(path, state, lambda staged, axis: write_checkpoint(path, staged, topo, step, files,
                                                                            keep=keep, axis=axis))


def write_checkpoint(path: Path, state: dict[str, Any], topo: Topology, step: int,
                     files: Callable[[Path], None], keep: int = 0, axis: Axis | None = None) -> Path:
    """The one atomic sharded checkpoint writer (the trainer's and ``initialize()``'s engine's):
    every rank writes its pieces of ``state`` with ``torch.distributed.checkpoint``, rank 0 adds
    the small files (``files(tmp)``) and the manifest. Collective.

    Crash-safe: everything is fsynced into ``.tmp-<name>`` before ``complete.json`` (the
    manifest) is written and fsynced, then the directory is renamed in (an existing ``path`` is
    moved aside first and deleted after). A checkpoint that does not fit on the disk (estimated
    before writing, or a write that fails) raises one CheckpointError, leaves no temporary
    directory and keeps every earlier checkpoint. ``axis`` (default ``topo.world``): the ranks'
    process group for DCP and the agreements (the background writer's own, off the training's)."""
    path = Path(path)
    axis = topo.world if axis is None else axis
    root = path.parent
    tmp = path.with_name(f"{TMP}{path.name}")
    failure: str | None = None
    if topo.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _recover_dir(root)
            for leftover in root.glob(f"{TMP}*"):  # an interrupted save: never completed, never picked
                shutil.rmtree(leftover, ignore_errors=True)
            tmp.mkdir()
            os.chmod(tmp, dir_mode())
        except OSError as e:
            failure = f"checkpoint {path} could not be written: {_reason(e)}"
    need = _needed_bytes(state, axis)
    if topo.rank == 0 and failure is None:
        free = _free_bytes(root)
        if free is not None and free < need:
            failure = (f"not enough disk space for checkpoint {path}: it needs about {_size(need)}, "
                       f"{root} has {_size(free)} free; free some space, keep fewer checkpoints "
                       "(train.keep_checkpoints) or use another train.run_dir")
    _agree(axis, failure, path, tmp)
    error: BaseException | None = None
    try:
        with single_process_quiet():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), process_group=_group(axis),
                     no_dist=axis.size == 1)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        error = e
    _agree(axis, error, path, tmp, need)
    if topo.rank == 0:
        try:
            files(tmp)
            _publish(tmp, path, step, topo.world_size)
        except (OSError, RuntimeError) as e:
            error = e
    _agree(axis, error, path, tmp, need)
    if topo.rank == 0 and keep > 0:
        _retain(root, path, keep)
    axis.comm.barrier(axis)
    return path


def _publish(tmp: Path, path: Path, step: int, world_size: int) -> None:
    """Rank 0: complete ``tmp`` with the manifest, make it durable and readable as the umask
    allows, and rename it to ``path``."""
    publish_modes(tmp)
    for f in tmp.iterdir():
        _fsync_file(f)  # DCP fsynced its shards; the small files' writers may not have
    _write_durable(tmp / COMPLETE, json.dumps({"step": step, "format": FORMAT, "time": time.time(),
                                               "world_size": world_size, "files": _manifest(tmp)}, indent=1) + "\n")
    _fsync_dir(tmp)
    root = path.parent
    aside = path.with_name(f"{OLD}{path.name}")
    if path.exists():  # re-saving a step: the old one stays whole (as .old-*) until the new is in place
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(path, aside)
        try:
            os.replace(tmp, path)
        except OSError:
            os.rename(aside, path)
            raise
    else:
        os.replace(tmp, path)
    _fsync_dir(root)
    if aside.exists():
        _remove(aside)


def _retain(root: Path, saved: Path, keep: int) -> None:
    """Rank 0, after ``saved`` is complete: delete the complete checkpoints older than it beyond
    the newest ``keep`` (``saved`` included). Newer steps (another run's) are left alone."""
    step = _step_of(saved)
    older = [p for p in _candidates(root) if p != saved and step is not None and (_step_of(p) or 0) < step]
    for p in older[keep - 1:]:
        _remove(p)
    _fsync_dir(root)


def _agree(axis: Axis, error: BaseException | str | None, path: Path, tmp: Path, need: int = 0) -> None:
    """Every rank learns whether any rank failed (one all-reduce); if so, rank 0 removes the
    temporary directory and every rank raises: a CheckpointError for a disk that is full or
    refuses the write, the original exception for anything else (a bug)."""
    flags = torch.tensor([0 if error is None else axis.rank + 1], dtype=torch.int64)
    axis.comm.all_reduce(flags, axis, op="max")
    failed = int(flags[0])
    if not failed:
        return
    if axis.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if isinstance(error, str):
        raise agreed(CheckpointError(error), own=True)
    if error is None:
        raise agreed(CheckpointError(f"checkpoint {path} was not saved: rank {failed - 1} could not write it (see "
                                     "its error); the previous checkpoints are intact"), own=False)
    if _disk_full(error):
        free = _free_bytes(path.parent)
        raise agreed(CheckpointError(f"checkpoint {path} does not fit on the disk: it needs about {_size(need)}, "
                                     f"{path.parent} has {_size(free) if free is not None else 'unknown'} free "
                                     f"({_reason(error)}); free some space, keep fewer checkpoints "
                                     "(train.keep_checkpoints) or use another train.run_dir — the previous "
                                     "checkpoints are intact"), own=True) from None
    if isinstance(error, OSError) or isinstance(_root_cause(error), OSError):
        raise agreed(CheckpointError(f"checkpoint {path} could not be written: {_reason(error)}; "
                                     "the previous checkpoints are intact"), own=True) from None
    raise error


def _needed_bytes(state: Any, axis: Axis) -> int:
    """Estimated size of the checkpoint from the state's tensors: the pieces of sharded tensors
    summed over ranks, replicated tensors (written once) counted once; plus room for the small
    files."""
    sharded, plain = _tensor_bytes(state)
    counts = torch.tensor([sharded], dtype=torch.int64)
    axis.comm.all_reduce(counts, axis, op="sum")
    biggest = torch.tensor([plain], dtype=torch.int64)
    axis.comm.all_reduce(biggest, axis, op="max")
    return int(counts[0]) + int(biggest[0]) + _SMALL_FILES


def _tensor_bytes(tree: Any) -> tuple[int, int]:
    """(bytes of DTensor pieces held here, bytes of plain tensors) in a nested state."""
    if isinstance(tree, DTensor):
        local = tree.to_local()
        return local.numel() * local.element_size(), 0
    if isinstance(tree, torch.Tensor):
        return 0, tree.numel() * tree.element_size()
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    sharded = plain = 0
    for v in items:
        s, p = _tensor_bytes(v)
        sharded, plain = sharded + s, plain + p
    return sharded, plain


def load(path: Path, model: nn.Module, optimizer: ZeroOptimizer, cfg: Config, topo: Topology,
         extra: dict[str, Any] | None = None) -> int:
    """Restore model, optimizer, RNG and ``extra`` (filled in place: pass the same structure
    that was saved) from a complete checkpoint; returns its step."""
    path = Path(path)
    info = read_info(require_complete(path))
    saved = read_config(path)
    check_compatible(saved, cfg, path)
    state = _train_state(model, optimizer, extra)
    if saved.parallel != cfg.parallel or saved.parallel.grad_compression != "int8":
        state.pop("residuals", None)  # each rank's own error feedback: only the same layout has it
    own_names = [list(group["params"]) for group in state["optim"]["param_groups"]]
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=SafeReader(str(path)), process_group=_group(topo.world),
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
    inner = next((x for x in _causes(e) if isinstance(x, CheckpointError)), None)
    if inner is not None:
        return CheckpointError(str(inner))
    return CheckpointError(f"checkpoint {path} could not be loaded: {_reason(e)}{hint}")


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


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that a single-process save/load is single-process (it is meant)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def _train_state(model: nn.Module, optimizer: ZeroOptimizer, extra: dict[str, Any] | None) -> dict[str, Any]:
    """What a checkpoint holds, keyed by parameter name: the parameters this rank trains (all
    of them, or one pipeline stage's), the model's buffers and their optimizer state, as DTensor
    pieces of the full tensors where tp or ZeRO split them, so DCP stores each piece once and
    any other layout reads the pieces it needs (every ZeRO stage, 0 included, is one path)."""
    return {**optimizer.checkpoint_state(model), "rng": {"torch_cpu": torch.get_rng_state()},
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


def require_complete(path: Path) -> Path:
    """``path`` if it is a whole checkpoint whose files all match their checksums, else one
    CheckpointError saying what is wrong and naming the newest earlier checkpoint that is whole."""
    path = Path(path)
    if path.is_dir() and not is_complete(path):
        raise CheckpointError(f"checkpoint {path} {_not_a_checkpoint(path, resume=False)}")
    why = _problem(path, deep=True)
    if why is None:
        return path
    hint = "" if not path.is_dir() or not is_complete(path) else _use_earlier(path)
    raise CheckpointError(f"checkpoint {why}{hint}")


def _manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file in the checkpoint (DCP's shards and metadata, config,
    tokenizer), checked before each load."""
    return {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)}
            for f in sorted(folder.iterdir()) if f.is_file() and f.name != COMPLETE}


def _group(axis: Axis) -> Any:
    """The process group of ``axis`` (every rank; None in a single process: DCP then needs none)."""
    return axis.group if axis.size > 1 else None
