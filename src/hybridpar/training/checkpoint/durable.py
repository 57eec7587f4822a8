"""Durable writes for checkpoints: fsync of files and directories, free space, telling a full
disk from other write failures (also inside DCP's wrapped per-rank failures), and file hashes."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException


def causes(e: BaseException) -> Iterator[BaseException]:
    """``e``, the per-rank failures DCP wrapped in it, and their causes."""
    seen: set[int] = set()
    todo = [e]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        if isinstance(x, CheckpointException):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in x.failures.values())
        todo.extend(c for c in (x.__cause__, x.__context__) if c is not None)


def root_cause(e: BaseException) -> BaseException:
    """The first per-rank failure inside a DCP CheckpointException (else ``e``)."""
    if isinstance(e, CheckpointException) and e.failures:
        first = next(iter(e.failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return e


def disk_full(e: BaseException) -> bool:
    """Whether a write failed for want of space: ENOSPC/EDQUOT, or torch's zip writer's short
    write (``unexpected pos ...``), which is how a full disk shows inside ``torch.save``."""
    for x in causes(e):
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(x)
        if "No space left" in text or "unexpected pos" in text or "Disk quota exceeded" in text:
            return True
    return False


def reason(e: BaseException) -> str:
    """One line about ``e`` (DCP's multi-line CheckpointException: its first failure)."""
    cause = root_cause(e)
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0][:300] if lines else ''}".rstrip(": ")


def free_bytes(folder: Path) -> int | None:
    """Free bytes on the filesystem of ``folder`` (None where it cannot be asked)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def size_text(n: int) -> str:
    """``n`` bytes for a message: exact, and in MiB."""
    return f"{n} bytes ({n / 2**20:.1f} MiB)"


def write_durable(path: Path, text: str) -> None:
    """Write and fsync a file (inside a temporary checkpoint directory: no rename needed)."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fsync_file(path: Path) -> None:
    """Make a file's contents durable (for files whose writer did not fsync them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(folder: Path) -> None:
    """Make renames and creations in ``folder`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks (the manifest's checksum)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
