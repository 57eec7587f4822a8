"""Token sources: the built-in corpus (Python's own standard library, byte-level) and the
layout-invariant sampler that turns global sample ids into (input, target) windows."""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BYTE_VOCAB = 256


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
    return bytes(t for t in tokens if 0 <= t < BYTE_VOCAB).decode("utf-8", errors="replace")


@dataclass
class TokenSplits:
    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    source: str


def load_builtin(val_fraction: float = 0.05, max_bytes: int = 8 << 20) -> TokenSplits:
    """Byte tokens of the built-in corpus; the last ``val_fraction`` of files is validation."""
    chunks: list[bytes] = []
    total = 0
    for path in builtin_corpus_files():
        data = path.read_bytes() + b"\n\n"
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    n_val = max(1, int(len(chunks) * val_fraction))
    train = np.frombuffer(b"".join(chunks[:-n_val]), dtype=np.uint8)
    val = np.frombuffer(b"".join(chunks[-n_val:]), dtype=np.uint8)
    return TokenSplits(train=train, val=val, vocab_size=BYTE_VOCAB, source="python-stdlib")


def load_tokens(data: str) -> TokenSplits:
    """Resolve ``train.data``: ``builtin`` or a text file / directory of text files (bytes)."""
    if data == "builtin":
        return load_builtin()
    path = Path(data)
    if not path.exists():
        raise FileNotFoundError(f"train.data = {data!r} does not exist; use 'builtin' or a path to text files")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    blob = b"\n\n".join(p.read_bytes() for p in files)
    if len(blob) < 1024:
        raise ValueError(f"train.data = {data!r} holds {len(blob)} bytes; need at least 1024 bytes of text")
    cut = int(len(blob) * 0.95)
    arr = np.frombuffer(blob, dtype=np.uint8)
    return TokenSplits(train=arr[:cut], val=arr[cut:], vocab_size=BYTE_VOCAB, source=str(path))


class WindowSampler:
    """Global sample id -> a (seq_len + 1)-token window of a token array.

    The corpus is cut into non-overlapping windows, visited in a fresh seeded permutation each
    epoch. Sample ids are global: whatever the data-parallel size, step ``s`` consumes ids
    ``s * global_batch ... (s + 1) * global_batch - 1``, so every layout sees the same data and a
    resumed run continues from the step alone.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is shorter than one sequence of {seq_len + 1}")
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
