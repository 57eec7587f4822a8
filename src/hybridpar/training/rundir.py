"""The run directory's ownership: one job at a time, and an earlier run is never deleted.

A new run into a directory that holds an earlier run moves that run to the next free numbered
backup (``<run_dir>.1``, ``<run_dir>.2``, ...), so typing the same command twice never costs a
run its checkpoints. A job holds an advisory lock on the run directory for its whole life
(``.<name>.lock`` beside it, an ``flock``): a second job into the same directory is refused
with one line naming the holder. The kernel drops the lock when its holder dies, so a lock file
left by a killed job never blocks a new run.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from hybridpar.errors import UserError

__all__ = ["LOCK_HELD_ENV", "RunDirBusy", "backup_previous_run", "check_writable", "hold_run_dir",
           "lock_path"]

# Set by the launching process for its workers: the lock file it already holds for them.
LOCK_HELD_ENV = "HYBRIDPAR_RUN_DIR_LOCK"


class RunDirBusy(UserError):
    """Another live job holds the run directory."""


def lock_path(run_dir: Path) -> Path:
    """The lock file of ``run_dir``: beside it, so moving the directory never moves the lock."""
    run_dir = Path(run_dir).absolute()
    return run_dir.with_name(f".{run_dir.name}.lock")


def check_writable(run_dir: Path) -> None:
    """Raise a :class:`UserError` naming ``run_dir`` and the fix when this process cannot
    create it or write in it (checked by writing a probe file in its nearest existing folder,
    which also catches a read-only mount, where root's permission bits say nothing): checked
    before any worker is launched."""
    run_dir = Path(run_dir).absolute()
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    why = "is not a directory" if not existing.is_dir() else ""
    if not why:
        try:
            with tempfile.TemporaryFile(dir=existing, prefix=".hybridpar-probe-"):
                pass
        except OSError as e:
            why = f"is not writable ({e.strerror or e})"
    if why:
        raise UserError(f"train.run_dir {run_dir}: {existing} {why}; "
                        "choose a writable directory with --train.run_dir DIR")


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, command: str = "") -> Iterator[None]:
    """Hold ``run_dir``'s lock while the block runs; refuse (:class:`RunDirBusy`, one line naming
    the holder's process, host and command) when another live job holds it. A no-op when this
    process's launcher holds it already (:data:`LOCK_HELD_ENV`)."""
    path = lock_path(run_dir)
    if os.environ.get(LOCK_HELD_ENV) == str(path):
        yield
        return
    check_writable(path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            raise RunDirBusy(f"train.run_dir {Path(run_dir)} is in use by a running job ({holder}); wait for "
                             "it to finish or choose another --train.run_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}"
                      f"{': ' + command if command else ''}\n".encode(), 0)
        saved = os.environ.get(LOCK_HELD_ENV)
        os.environ[LOCK_HELD_ENV] = str(path)  # this process's workers inherit the lock
        try:
            yield
        finally:
            _restore_env(saved)
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def _restore_env(saved: str | None) -> None:
    if saved is None:
        os.environ.pop(LOCK_HELD_ENV, None)
    else:
        os.environ[LOCK_HELD_ENV] = saved


def _describe(run_dir: Path) -> str:
    """``3 checkpoints, metrics to step 40``: what a backup holds, for the line that names it."""
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").is_dir() else []
    files = sum(1 for _ in run_dir.rglob("*"))
    what = f"{len(ckpts)} checkpoint(s), latest {ckpts[-1]}" if ckpts else "no checkpoints"
    return f"{what}, {files} files"


def backup_previous_run(run_dir: Path) -> Path | None:
    """Move an earlier run in ``run_dir`` to the next free ``<run_dir>.N`` (numbers only grow,
    so the highest is the newest backup) and return where; None when there was none. Nothing
    is ever deleted."""
    run_dir = Path(run_dir)
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return None
    pattern = re.compile(re.escape(run_dir.name) + r"\.(\d+)")
    taken = [int(m.group(1)) for p in run_dir.parent.iterdir() if (m := pattern.fullmatch(p.name))]
    backup = run_dir.with_name(f"{run_dir.name}.{max(taken, default=0) + 1}")
    what = _describe(run_dir)
    run_dir.rename(backup)
    print(f"hybridpar: moved the previous run in {run_dir} ({what}) to {backup}", flush=True)
    return backup
