"""Token sources: prepared datasets (see ``hybridpar prepare``), the built-in corpus (Python's own
standard library, byte-level, prepared once into a cache directory), and the layout-invariant
sampler that turns global sample ids into (input, target) windows."""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

from hybridpar.data.dataset import FORMAT_VERSION, META_FILE, TokenSplits, load_dataset
from hybridpar.data.errors import DataError, DatasetExistsError, split_too_short
from hybridpar.data.prepare import prepare_dataset
from hybridpar.data.tokenizer import BYTE_VOCAB, ByteTokenizer
from hybridpar.fsutil import cache_root

__all__ = ["BYTE_VOCAB", "TokenSplits", "WindowSampler", "builtin_cache_dir", "builtin_corpus_files",
           "decode_bytes", "encode_bytes", "load_builtin", "load_tokens"]


def builtin_corpus_files() -> list[Path]:
    """The top-level ``*.py`` files of the running Python's standard library: real text that is
    present on every machine with Python, so the default run needs no download."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no *.py files under the standard library at {stdlib}; pass train.data")
    return files


def encode_bytes(text: str) -> np.ndarray:
    """Byte-level tokens: one token per UTF-8 byte, vocabulary 256."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode_bytes(tokens: list[int]) -> str:
    return ByteTokenizer().decode(tokens)


def _builtin_selection(max_bytes: int) -> list[Path]:
    """Standard-library files in sorted order until ``max_bytes`` is reached (the last one included)."""
    chosen, total = [], 0
    for path in builtin_corpus_files():
        chosen.append(path)
        total += path.stat().st_size
        if total >= max_bytes:
            break
    return chosen


def builtin_cache_dir(files: list[Path], val_fraction: float, max_bytes: int) -> Path:
    """Cache directory named by a hash of the Python version, the file list and the settings."""
    key = json.dumps([sys.version, FORMAT_VERSION, val_fraction, max_bytes,
                      [(str(p), p.stat().st_size) for p in files]])
    return cache_root() / f"builtin-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def load_builtin(val_fraction: float = 0.05, max_bytes: int = 8 << 20) -> TokenSplits:
    """Byte tokens of the built-in corpus; the last ``val_fraction`` of files is validation.

    Prepared with the byte tokenizer on first use into :func:`builtin_cache_dir` and loaded from
    there afterwards; a cache that fails verification is rebuilt. Concurrent first uses (several
    ranks) each prepare, the first rename wins and the others load its result."""
    files = _builtin_selection(max_bytes)
    cache = builtin_cache_dir(files, val_fraction, max_bytes)
    force = cache.exists()
    if (cache / META_FILE).is_file():
        try:
            data = load_dataset(cache)
        except DataError:
            force = True
        else:
            if data.train_docs is not None:  # a cache from before document offsets: prepare again
                data.source = "python-stdlib"
                return data
    with contextlib.suppress(DatasetExistsError):  # raised when another process finished first
        prepare_dataset(files, cache, tokenizer="bytes", val_fraction=val_fraction, force=force,
                        text_suffixes=(".py",))
    data = load_dataset(cache)
    data.source = "python-stdlib"
    return data


def load_tokens(data: str) -> TokenSplits:
    """Resolve ``train.data``: ``builtin`` or a dataset directory written by ``hybridpar prepare``."""
    if data == "builtin":
        return load_builtin()
    return load_dataset(Path(data))


class WindowSampler:
    """Global sample id -> a (seq_len + 1)-token window of a token array.

    The corpus is cut into non-overlapping windows, visited in a fresh seeded permutation each
    epoch. Sample ids are global: whatever the data-parallel size, step ``s`` consumes ids
    ``s * global_batch ... (s + 1) * global_batch - 1``, so every layout sees the same data and a
    resumed run continues from the step alone.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int, split: str | None = None,
                 source: str | None = None, docs: np.ndarray | None = None) -> None:
        """``split`` ("train", "val") and ``source`` (the dataset) only name the data in errors;
        ``docs``: the split's document start offsets (for :meth:`doc_ids`), None if not recorded."""
        self.tokens = tokens
        self.docs = docs
        self.split, self.source = split, source
        self.seq_len = seq_len
        self.seed = seed
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise split_too_short(split, len(tokens), seq_len, source)
        self._perm_epoch = -1
        self._perm = np.arange(self.windows)

    def _window(self, sample_id: int) -> int:
        epoch, i = divmod(sample_id, self.windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows)
            self._perm_epoch = epoch
        return int(self._perm[i])

    def batch(self, sample_ids: range | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each int64 [len(sample_ids), seq_len]."""
        rows = []
        for sid in sample_ids:
            start = self._window(sid) * self.seq_len
            rows.append(self.tokens[start : start + self.seq_len + 1].astype(np.int64))
        block = torch.from_numpy(np.stack(rows))
        return block[:, :-1], block[:, 1:]

    def doc_ids(self, sample_ids: range | list[int]) -> torch.Tensor:
        """Document index of every input token of :meth:`batch`'s windows, int64
        ``[len(sample_ids), seq_len]`` (the index of the document in the split, so labels from
        different windows or datasets need not differ: compare them within one sequence)."""
        if self.docs is None:
            where = f"dataset {self.source!r}" if self.source else "this dataset"
            raise DataError(f"train.document_mask = true needs document offsets, but {where} "
                            f"({self.split or 'split'}) has none recorded; prepare it again with hybridpar prepare")
        offsets = np.asarray(self.docs, dtype=np.int64)
        rows = []
        for sid in sample_ids:
            start = self._window(sid) * self.seq_len
            pos = np.arange(start, start + self.seq_len, dtype=np.int64)
            rows.append(np.searchsorted(offsets, pos, side="right") - 1)
        return torch.from_numpy(np.stack(rows).astype(np.int64))
