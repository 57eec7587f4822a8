"""Where checkpoints live and which one to resume: ``<run_dir>/checkpoints/step-000010/``, the
newest whole one, and the tidying after a crash.

A save builds ``.tmp-step-N`` and renames it in once whole; re-saving step N first moves the old
directory aside (``.old-step-N``), and a deletion first renames to ``.del-step-N``, so a
half-deleted checkpoint is never mistaken for one. :func:`recover` finishes what a crash
interrupted. Only ``step-*`` directories that pass :func:`~.manifest.problem` are ever picked.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path

from hybridpar.distributed.lifecycle import says_job_notices
from hybridpar.training.checkpoint.durable import fsync_dir
from hybridpar.training.checkpoint.manifest import COMPLETE, is_complete, problem
from hybridpar.training.checkpoint.safe_metadata import CheckpointError

CKPT_DIR = "checkpoints"

TMP, OLD, DEL = ".tmp-", ".old-", ".del-"  # prefixes of a save in progress, a replaced step, a deletion


def step_dir(run_dir: Path, step: int) -> Path:
    """Where step ``step``'s checkpoint of the run in ``run_dir`` lives (``checkpoints/step-NNNNNN``)."""
    return Path(run_dir) / CKPT_DIR / f"step-{step:06d}"


def step_of(path: Path) -> int | None:
    """N of a directory named ``step-N``, else None."""
    name = Path(path).name
    digits = name[len("step-"):]
    return int(digits) if name.startswith("step-") and digits.isdigit() else None


def candidates(root: Path) -> list[Path]:
    """The ``step-N`` directories under ``root`` that have a ``complete.json``, newest first."""
    if not root.is_dir():
        return []
    found = [(s, p) for p in root.iterdir() if (s := step_of(p)) is not None and p.is_dir() and is_complete(p)]
    return [p for _, p in sorted(found, reverse=True)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest whole ``step-*`` checkpoint under ``run_dir`` (a valid ``complete.json`` and
    every file it lists, at its size; checksums are not read), or None. Leftovers of an
    interrupted save (``.tmp-*``, ``.old-*``, ``.del-*``) are never picked."""
    return next((p for p in candidates(Path(run_dir) / CKPT_DIR) if problem(p, deep=False) is None), None)


def latest_verified_checkpoint(run_dir: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest checkpoint under ``run_dir`` that passes :func:`require_complete` (every
    checksum), and the newer ones skipped on the way, each with the reason."""
    skipped: list[tuple[Path, str]] = []
    for p in candidates(Path(run_dir) / CKPT_DIR):
        why = problem(p, deep=True)
        if why is None:
            return p, skipped
        skipped.append((p, why))
    return None, skipped


def _earlier(path: Path) -> Path | None:
    """The newest verified checkpoint beside ``path`` with a lower step (for error messages)."""
    step = step_of(path)
    for p in candidates(Path(path).parent):
        if p != path and (step is None or (step_of(p) or 0) < step) and problem(p, deep=True) is None:
            return p
    return None


def recover(run_dir: Path) -> None:
    """Finish what a crash interrupted under ``run_dir/checkpoints``: an ``.old-step-N`` (moved
    aside to re-save step N) is put back when no whole ``step-N`` replaced it, and removed when
    one did; ``.del-*`` (checkpoints being deleted) are removed. Safe to run on several ranks at
    once (each step is a rename that at most one wins); not while a save is running."""
    recover_dir(Path(run_dir) / CKPT_DIR)


def recover_dir(root: Path) -> None:
    """:func:`recover` on the checkpoint directory ``root`` itself (the writer's tidy-up before a save)."""
    if not root.is_dir():
        return
    for p in sorted(root.iterdir()):
        if p.name.startswith(DEL):
            shutil.rmtree(p, ignore_errors=True)
        elif p.name.startswith(OLD) and step_of(Path(p.name[len(OLD):])) is not None:
            target = root / p.name[len(OLD):]
            if target.exists() and problem(target, deep=False) is None:
                remove(p)
            elif not target.exists() and problem(p, deep=False) is None:
                with contextlib.suppress(OSError):
                    os.rename(p, target)
                    fsync_dir(root)
            elif not target.exists():
                remove(p)


def remove(path: Path) -> None:
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
    why = problem(path, deep=False)
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
    """The end of an error message about ``path``: which earlier checkpoint to resume from."""
    earlier = _earlier(path)
    if earlier is None:
        return f" — there is no earlier complete checkpoint in {path.parent}"
    return f" — resume from the earlier complete checkpoint {earlier} (--resume {earlier})"


def require_complete(path: Path) -> Path:
    """``path`` if it is a whole checkpoint whose files all match their checksums, else one
    CheckpointError saying what is wrong and naming the newest earlier checkpoint that is whole."""
    path = Path(path)
    if path.is_dir() and not is_complete(path):
        raise CheckpointError(f"checkpoint {path} {_not_a_checkpoint(path, resume=False)}")
    why = problem(path, deep=True)
    if why is None:
        return path
    hint = "" if not path.is_dir() or not is_complete(path) else _use_earlier(path)
    raise CheckpointError(f"checkpoint {why}{hint}")
