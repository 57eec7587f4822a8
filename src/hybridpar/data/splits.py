"""The end of ``hybridpar prepare``: the one token stream written as ``all-*`` shards is cut into
the train and val splits (the val tail copied, the shard holding the cut truncated and hashed
again), and each input is told which split its records went to.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from hybridpar.data.dataset import DOCS_DTYPE, ShardWriter
from hybridpar.data.errors import DataError
from hybridpar.data.sources import Source

EMPTY_FILE = "empty-records.tmp"  # global indices of empty records, while writing (removed by split_stream)
_COPY = 1 << 19  # tokens or document offsets per copy in split_stream (a few MiB): bounded memory


def split_stream(tmp: Path, whole: dict[str, Any], dtype: np.dtype, shard_tokens: int, val_fraction: float,
                 first_val: int | None, files: list[Path]) -> dict[str, Any]:
    """Cut the token stream written as ``all-*`` into the train and val splits.

    ``first_val``: the first validation record; val starts at the first document of a record at or
    after it (empty records have none). None (a single record): the last ``val_fraction`` of its
    tokens (at least one) is the validation split, and both splits hold that one document.
    Train keeps the shards before the cut (renamed, the one holding the cut truncated and hashed
    again); the tail, normally ``val_fraction`` of the tokens, is copied into val shards."""
    val = ShardWriter(tmp, "val", dtype, shard_tokens)
    try:
        return _cut(tmp, whole, val, dtype, val_fraction, first_val, files)
    except BaseException:
        val.abort()
        raise


def _cut(tmp: Path, whole: dict[str, Any], val: ShardWriter, dtype: np.dtype, val_fraction: float,
         first_val: int | None, files: list[Path]) -> dict[str, Any]:
    """``split_stream``'s work, ``val`` opened (and aborted by it on error)."""
    n, itemsize = int(whole["tokens"]), dtype.itemsize
    docs_path = tmp / whole["documents"]["file"]
    n_docs = int(whole["documents"]["count"])
    if first_val is None:
        cut = n - max(1, int(n * val_fraction))
        if cut < 1:
            raise DataError(f"input {str(files[0])!r} gives only {n} tokens; a single input needs at least 2 (one "
                            "train, one validation); pass more text")
        n_train_docs = n_docs
        val.add_documents([0])
    else:
        empty_path = tmp / EMPTY_FILE
        n_train_docs = first_val
        if empty_path.is_file() and empty_path.stat().st_size:
            empty = np.memmap(empty_path, dtype="<i8", mode="r")
            n_train_docs -= int(np.searchsorted(empty, first_val))
            del empty
        cut = int(np.fromfile(docs_path, dtype=DOCS_DTYPE, count=1, offset=n_train_docs * DOCS_DTYPE.itemsize)[0]) \
            if n_train_docs < n_docs else n
        for lo in range(n_train_docs, n_docs, _COPY):
            hi = min(lo + _COPY, n_docs)
            val.add_documents(np.fromfile(docs_path, dtype=DOCS_DTYPE, count=hi - lo, offset=lo * DOCS_DTYPE.itemsize) - cut)
        empty_path.unlink(missing_ok=True)
    train_shards, pos = [], 0
    for shard in whole["shards"]:
        lo, hi, path = pos, pos + int(shard["tokens"]), tmp / shard["file"]
        pos = hi
        for a in range(max(cut, lo), hi, _COPY):  # the part after the cut: validation
            b = min(a + _COPY, hi)
            val.write(np.fromfile(path, dtype=dtype, count=b - a, offset=(a - lo) * itemsize))
        if lo >= cut:
            path.unlink()
            continue
        name = shard["file"].replace("all-", "train-", 1)
        entry = dict(shard, file=name)
        if hi > cut:
            entry.update(tokens=cut - lo, sha256=_truncate(path, (cut - lo) * itemsize))
        path.rename(tmp / name)
        train_shards.append(entry)
    docs_file = "train-docs.bin"
    docs_sha = _truncate(docs_path, n_train_docs * DOCS_DTYPE.itemsize)
    docs_path.rename(tmp / docs_file)
    train = {"tokens": cut, "shards": train_shards,
             "documents": {"file": docs_file, "count": n_train_docs, "dtype": "int64", "sha256": docs_sha}}
    return {"train": train, "val": val.close()}


def _truncate(path: Path, size: int) -> str:
    """Cut ``path`` to ``size`` bytes (durably) and return the sha256 of what is left, read in
    1 MiB pieces into one buffer (a shard can be large; peak memory should not grow with it)."""
    h, buf = hashlib.sha256(), bytearray(1 << 20)
    view = memoryview(buf)
    with open(path, "r+b", buffering=0) as f:
        if os.fstat(f.fileno()).st_size != size:
            f.truncate(size)
            os.fsync(f.fileno())
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def sources_meta(sources: list[Source], sizes: list[int], counts: list[int], first_val: int,
                 n_val: int) -> list[dict[str, Any]]:
    """Each input's ``meta.json`` entry: its format, size, record count and the split(s) its
    records went to (None for an input with no records)."""
    out, index = [], 0
    for src, size, count in zip(sources, sizes, counts, strict=True):
        if count == 0:
            split = None
        elif not n_val:
            split = "train+val"
        elif index >= first_val:
            split = "val"
        elif index + count > first_val:
            split = "train+val"
        else:
            split = "train"
        out.append({"path": src.name, "format": src.kind, "bytes": size, "records": count, "split": split})
        index += count
    return out
