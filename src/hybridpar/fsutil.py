"""File modes for what hybridpar publishes: the modes a plain ``open()`` / ``mkdir()`` would give.

Atomic writers build their output under a temporary name and rename it into place. Temporary
files and directories (``tempfile.mkstemp`` / ``mkdtemp``, and the safetensors writer) are
private (0600 / 0700), and a rename keeps the mode, so without :func:`publish_modes` a prepared
dataset or an exported model would be readable by its owner only. Published files get
``0o666 & ~umask`` and directories ``0o777 & ~umask``: with the usual umask 022 a team can read
them, with umask 077 they stay private, as the user asked.

Low level: imports nothing from hybridpar, so every layer may use it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
import threading
from pathlib import Path

__all__ = ["atomic_write_text", "current_umask", "dir_mode", "file_mode", "publish_modes"]

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (``/proc``); elsewhere by
    setting and restoring it under a lock."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def file_mode() -> int:
    """Mode of a published regular file: ``0o666 & ~umask``."""
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    """Mode of a published directory: ``0o777 & ~umask``."""
    return 0o777 & ~current_umask()


def publish_modes(path: str | Path) -> None:
    """Give ``path`` (a file, or a directory and everything below it) the modes a plain
    ``open``/``mkdir`` would: files ``0o666 & ~umask``, directories ``0o777 & ~umask``.
    Symbolic links are neither followed nor changed. Call it before renaming into place."""
    path = Path(path)
    fmode, dmode = file_mode(), dir_mode()
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode):
        return
    if not stat.S_ISDIR(st.st_mode):
        os.chmod(path, fmode)
        return
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, fmode)
        for name in dirs:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, dmode)
    os.chmod(path, dmode)


def atomic_write_text(path: Path, text: str) -> None:
    """Write a whole file or nothing: a unique temporary sibling, fsync, publish modes, rename over.
    Concurrent writers of the same path never mix their text: the last rename wins."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def cache_root() -> Path:
    """``$HYBRIDPAR_CACHE``, else ``$XDG_CACHE_HOME/hybridpar``, else ``~/.cache/hybridpar``."""
    if os.environ.get("HYBRIDPAR_CACHE"):
        return Path(os.environ["HYBRIDPAR_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hybridpar"
