"""Offload to disk (ZeRO-Infinity): ZeRO state in memory-mapped files, read ahead before use.

With ``offload_to = "disk"`` every ZeRO group (a stage-1/2 bucket or a stage-3 unit) keeps its
host-side fp32 state in one file of its own (:class:`DiskArena`): the fp32 master rows, the
host gradient rows and each per-element optimizer state (Adam's ``exp_avg``, ``exp_avg_sq``),
each a contiguous ``S``-element region. The tensors the optimizer steps are views of the file's
memory map, so the update is the ordinary in-place one and the result equals CPU offload bit
for bit. Between uses a group's pages are written back and dropped (``msync``,
``MADV_DONTNEED``, ``POSIX_FADV_DONTNEED``): resident optimizer state is then about 0 bytes,
the kernel's page cache included. Before a group is needed, ``MADV_WILLNEED`` starts the
kernel's asynchronous read-ahead of its file, one group ahead of the update (and, for ZeRO-3
parameter shards, one unit ahead of the gather), so reading overlaps the previous group's work.

Files are created in ``offload_dir`` (default: ``hybridpar-offload`` in the system temporary
directory) under unique names (``rank<r>-<name>-<random>``) and unlinked at once: the space is
returned when the process exits, even after a crash, and nothing is left in the directory.
:meth:`DiskArena.resident_bytes` asks the kernel (``mincore``) how much of a file is in memory.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
from pathlib import Path

import torch

_PAGE = mmap.PAGESIZE


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover - every Linux and macOS has one
        return None


_LIBC = _libc()


class DiskArena:
    """One memory-mapped fp32 file of ``numel`` elements: :attr:`tensor` views all of it."""

    def __init__(self, directory: Path, prefix: str, numel: int) -> None:
        self.nbytes = max(_PAGE, 4 * numel)
        self._fd, path = tempfile.mkstemp(prefix=prefix, dir=directory)  # O_EXCL, mode 0600
        os.unlink(path)  # the space lives as long as the mapping: nothing left behind on exit
        os.ftruncate(self._fd, self.nbytes)
        self._map = mmap.mmap(self._fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor = torch.frombuffer(self._map, dtype=torch.float32, count=numel)

    def prefetch(self) -> None:
        """Start reading the file into memory in the background (returns at once)."""
        self._map.madvise(mmap.MADV_WILLNEED)

    def evict(self) -> None:
        """Write dirty pages back and drop every page from memory (this process's mapping and
        the page cache): the next access reads the file."""
        self._map.flush()
        self._map.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(self._fd, 0, self.nbytes, os.POSIX_FADV_DONTNEED)

    def resident_bytes(self) -> int:
        """Bytes of this file in memory now (``mincore`` over the mapping)."""
        if _LIBC is None:
            return 0
        pages = -(-self.nbytes // _PAGE)
        vec = (ctypes.c_ubyte * pages)()
        if _LIBC.mincore(ctypes.c_void_p(self.tensor.data_ptr()), ctypes.c_size_t(self.nbytes), vec) != 0:
            return 0
        return sum(b & 1 for b in vec) * _PAGE


class DiskStore:
    """Where one rank's offload files go: ``<offload_dir>/rank<r>-<name>-<random>``, each
    unlinked as soon as it is open (no per-rank folder to leave behind)."""

    def __init__(self, offload_dir: str | os.PathLike[str] | None, rank: int) -> None:
        self.dir = Path(offload_dir) if offload_dir else Path(tempfile.gettempdir()) / "hybridpar-offload"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.arenas: list[DiskArena] = []

    def arena(self, name: str, numel: int) -> DiskArena:
        """A new file-backed region of ``numel`` fp32 elements (zeros)."""
        out = DiskArena(self.dir, f"rank{self.rank}-{name}-", numel)
        self.arenas.append(out)
        return out

    def resident_bytes(self) -> int:
        """Bytes of all this store's files in memory now."""
        return sum(a.resident_bytes() for a in self.arenas)
