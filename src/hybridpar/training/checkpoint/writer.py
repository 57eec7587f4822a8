"""The one atomic sharded checkpoint writer (the trainer's, the background writer's and
``initialize()``'s engine's): every rank writes its pieces with ``torch.distributed.checkpoint``
into ``.tmp-step-N``, the ranks agree that all of them succeeded, rank 0 adds the small files and
``complete.json`` and renames the directory in. A checkpoint that does not fit on the disk is one
:class:`~hybridpar.training.checkpoint.safe_metadata.CheckpointError` that keeps every earlier
checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from hybridpar.distributed.mesh import Axis, Topology
from hybridpar.errors import agreed
from hybridpar.fsutil import dir_mode, publish_modes
from hybridpar.training.checkpoint.durable import (
    disk_full,
    free_bytes,
    fsync_dir,
    fsync_file,
    reason,
    root_cause,
    size_text,
)
from hybridpar.training.checkpoint.manifest import write_complete
from hybridpar.training.checkpoint.paths import OLD, TMP, candidates, recover_dir, remove, step_of
from hybridpar.training.checkpoint.safe_metadata import CheckpointError

SMALL_FILES = 1 << 20  # room for .metadata, config.json and the tokenizer on top of the tensors


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Silence DCP's warning that a single-process save/load is single-process (it is meant)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        yield


def process_group(axis: Axis) -> Any:
    """The process group of ``axis`` (every rank; None in a single process: DCP then needs none)."""
    return axis.group if axis.size > 1 else None


def write_checkpoint(path: Path, state: dict[str, Any], topo: Topology, step: int,
                     files: Callable[[Path], None], keep: int = 0, axis: Axis | None = None) -> Path:
    """Write ``state`` as the complete checkpoint ``path`` for ``step``: every rank writes its
    pieces of ``state`` with ``torch.distributed.checkpoint``, rank 0 adds the small files
    (``files(tmp)``) and the manifest. Collective.

    Crash-safe: everything is fsynced into ``.tmp-<name>`` before ``complete.json`` (the
    manifest) is written and fsynced, then the directory is renamed in (an existing ``path`` is
    moved aside first and deleted after). A checkpoint that does not fit on the disk (estimated
    before writing, or a write that fails) raises one CheckpointError, leaves no temporary
    directory and keeps every earlier checkpoint. ``keep`` > 0: delete the complete checkpoints
    older than this one beyond the newest ``keep``. ``axis`` (default ``topo.world``): the ranks'
    process group for DCP and the agreements (the background writer's own, off the training's)."""
    path = Path(path)
    axis = topo.world if axis is None else axis
    root = path.parent
    tmp = path.with_name(f"{TMP}{path.name}")
    failure = _prepare(root, tmp, path) if topo.rank == 0 else None
    need = _needed_bytes(state, axis)
    if topo.rank == 0 and failure is None:
        failure = _space_problem(root, path, need)
    _agree(axis, failure, path, tmp)
    error: BaseException | None = None
    try:
        with single_process_quiet():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp)), process_group=process_group(axis),
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


def _prepare(root: Path, tmp: Path, path: Path) -> str | None:
    """Rank 0, before a save: tidy ``root`` after any crash, drop interrupted saves' temporary
    directories and create ``tmp`` with the published mode; why it could not (None: it could)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        recover_dir(root)
        for leftover in root.glob(f"{TMP}*"):  # an interrupted save: never completed, never picked
            shutil.rmtree(leftover, ignore_errors=True)
        tmp.mkdir()
        os.chmod(tmp, dir_mode())
    except OSError as e:
        return f"checkpoint {path} could not be written: {reason(e)}"
    return None


def _space_problem(root: Path, path: Path, need: int) -> str | None:
    """Rank 0: why a checkpoint of about ``need`` bytes does not fit under ``root`` (None: it fits,
    or the free space cannot be asked)."""
    free = free_bytes(root)
    if free is not None and free < need:
        return (f"not enough disk space for checkpoint {path}: it needs about {size_text(need)}, "
                f"{root} has {size_text(free)} free; free some space, keep fewer checkpoints "
                "(train.keep_checkpoints) or use another train.run_dir")
    return None


def _publish(tmp: Path, path: Path, step: int, world_size: int) -> None:
    """Rank 0: complete ``tmp`` with the manifest, make it durable and readable as the umask
    allows, and rename it to ``path``."""
    publish_modes(tmp)
    for f in tmp.iterdir():
        fsync_file(f)  # DCP fsynced its shards; the small files' writers may not have
    write_complete(tmp, step, world_size)
    fsync_dir(tmp)
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
    fsync_dir(root)
    if aside.exists():
        remove(aside)


def _retain(root: Path, saved: Path, keep: int) -> None:
    """Rank 0, after ``saved`` is complete: delete the complete checkpoints older than it beyond
    the newest ``keep`` (``saved`` included). Newer steps (another run's) are left alone."""
    step = step_of(saved)
    older = [p for p in candidates(root) if p != saved and step is not None and (step_of(p) or 0) < step]
    for p in older[keep - 1:]:
        remove(p)
    fsync_dir(root)


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
    if disk_full(error):
        free = free_bytes(path.parent)
        raise agreed(CheckpointError(f"checkpoint {path} does not fit on the disk: it needs about {size_text(need)}, "
                                     f"{path.parent} has {size_text(free) if free is not None else 'unknown'} free "
                                     f"({reason(error)}); free some space, keep fewer checkpoints "
                                     "(train.keep_checkpoints) or use another train.run_dir — the previous "
                                     "checkpoints are intact"), own=True) from None
    if isinstance(error, OSError) or isinstance(root_cause(error), OSError):
        raise agreed(CheckpointError(f"checkpoint {path} could not be written: {reason(error)}; "
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
    return int(counts[0]) + int(biggest[0]) + SMALL_FILES


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
