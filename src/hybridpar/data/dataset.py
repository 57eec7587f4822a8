"""The on-disk format of a prepared dataset, its writer and its verified, memory-mapped loader.

A dataset directory holds::

    meta.json          written last: format version, tokenizer, vocab size, dtype, shards
                       (file, tokens, sha256) per split, total tokens per split, source files
    train-00000.bin    raw little-endian token ids (uint16 when vocab <= 65536, else uint32)
    val-00000.bin
    train-docs.bin     int64 little-endian: the offset of each document's first token in the
    val-docs.bin       split's token stream (its shards concatenated), ascending; meta.json lists
                       it under splits.<split>.documents (file, count, sha256). Datasets written
                       before it existed have no such entry.
    tokenizer.json     BPE and Hugging Face tokenizers (``tokenizers`` format); a Hugging Face
                       tokenizer's tokenizer_config.json / special_tokens_map.json beside it

A directory without ``meta.json`` is never accepted: ``prepare`` writes into a temporary sibling
and renames it into place only when complete. Loading checks every shard (present, size, sha256,
ids below the vocabulary) before handing out memory maps.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hybridpar.data.errors import (
    DataError,
    DataNotFoundError,
    TokenizerMismatchError,
    split_too_short,
)
from hybridpar.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

FORMAT = "hybridpar-tokens"
FORMAT_VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_CHUNK = 1 << 24  # bytes per read while verifying; a multiple of every itemsize


@dataclass
class TokenSplits:
    """Train and validation token ids (1-D integer arrays, possibly read-only memory maps) and the
    tokenizer that produced them (``encode`` / ``decode`` for prompts and samples)."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    source: str
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    meta: dict[str, Any] | None = None
    train_docs: np.ndarray | None = None  # int64 document start offsets (None: not recorded)
    val_docs: np.ndarray | None = None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, tokens: Any) -> str:
        return self.tokenizer.decode(tokens)


def dtype_name(dtype: np.dtype) -> str:
    return {v.str: k for k, v in DTYPES.items()}[np.dtype(dtype).newbyteorder("<").str]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(obj, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())


DOCS_DTYPE = np.dtype("<i8")


class ShardWriter:
    """Appends token arrays to ``<split>-NNNNN.bin`` files of at most ``shard_tokens`` tokens each,
    hashing as it writes, and document start offsets (``add_documents``) to ``<split>-docs.bin``.
    ``close()`` returns the split's entry for ``meta.json``."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, np.dtype(dtype), shard_tokens
        self.shards: list[dict[str, Any]] = []
        self.total = 0
        self._fh: Any = None
        self._hash: Any = None
        self._count = 0
        self.docs_file = f"{split}-docs.bin"
        self._docs_fh: Any = None
        self._docs_hash = hashlib.sha256()
        self.documents = 0

    def add_documents(self, starts: np.ndarray | list[int]) -> None:
        """Record documents that start at these offsets of the split's token stream."""
        arr = np.asarray(starts, dtype=DOCS_DTYPE)
        if not len(arr):
            return
        if self._docs_fh is None:
            self._docs_fh = open(self.directory / self.docs_file, "wb")  # noqa: SIM115 (closed in close / abort)
        buf = arr.tobytes()
        self._docs_fh.write(buf)
        self._docs_hash.update(buf)
        self.documents += len(arr)

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self.shards.append({"file": name, "tokens": 0, "sha256": ""})
        self._fh = open(self.directory / name, "wb")  # noqa: SIM115 (closed in _close_shard / abort)
        self._hash = hashlib.sha256()
        self._count = 0

    def _close_shard(self) -> None:
        if self._fh is None:
            return
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self.shards[-1].update(tokens=self._count, sha256=self._hash.hexdigest())
        self._fh = None

    def write(self, tokens: np.ndarray) -> None:
        arr = np.asarray(tokens).astype(self.dtype, copy=False)
        pos = 0
        while pos < len(arr):
            if self._fh is None:
                self._open()
            n = min(len(arr) - pos, self.shard_tokens - self._count)
            buf = arr[pos : pos + n].tobytes()
            self._fh.write(buf)
            self._hash.update(buf)
            self._count += n
            self.total += n
            pos += n
            if self._count == self.shard_tokens:
                self._close_shard()

    def close(self) -> dict[str, Any]:
        self._close_shard()
        if self._docs_fh is None:
            (self.directory / self.docs_file).write_bytes(b"")
        else:
            self._docs_fh.flush()
            os.fsync(self._docs_fh.fileno())
            self._docs_fh.close()
            self._docs_fh = None
        docs = {"file": self.docs_file, "count": self.documents, "dtype": "int64",
                "sha256": self._docs_hash.hexdigest()}
        return {"tokens": self.total, "shards": self.shards, "documents": docs}

    def abort(self) -> None:
        for name in ("_fh", "_docs_fh"):
            if getattr(self, name) is not None:
                getattr(self, name).close()
                setattr(self, name, None)


# ----------------------------------------------------------------------------- loading

_VERIFIED: set[tuple] = set()  # shards whose checksum matched in this process (keyed by stat)


def _fix(directory: Path) -> str:
    return f"re-run hybridpar prepare --input ... --out {directory} --force"


def read_meta(directory: Path) -> dict[str, Any]:
    """``meta.json`` of a prepared dataset, with its format version checked."""
    if not directory.exists():
        raise DataNotFoundError(f"dataset directory {str(directory)!r} does not exist; use 'builtin' or a "
                                "directory written by hybridpar prepare --input ... --out DIR")
    if not directory.is_dir():
        raise DataError(f"{str(directory)!r} is a file, not a prepared dataset: run hybridpar prepare "
                        f"--input {directory} --out DIR and pass DIR")
    path = directory / META_FILE
    if not path.is_file():
        raise DataNotFoundError(f"not a prepared dataset: {str(directory)!r} has no {META_FILE} (an interrupted "
                                f"or foreign directory); run hybridpar prepare --input ... --out {directory}")
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {str(path)!r} ({e}); {_fix(directory)}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{str(path)!r} is not a {FORMAT} meta file; {_fix(directory)}")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise DataError(f"{str(path)!r} has format version {version!r}, this hybridpar reads version "
                        f"{FORMAT_VERSION}; {_fix(directory)}")
    return meta


def check_seq_len(meta: dict[str, Any], seq_len: int, source: str | Path | None = None) -> None:
    """Before launch: every split of a dataset (its ``meta.json``) must hold at least one training
    sequence of ``seq_len + 1`` tokens (inputs and their shifted targets)."""
    tokens = meta.get("tokens")
    if not isinstance(tokens, dict):
        return  # malformed meta: load_dataset reports it with the fix
    for split in SPLITS:
        n = tokens.get(split)
        if isinstance(n, int) and n < seq_len + 1:
            raise split_too_short(split, n, seq_len, None if source is None else str(source))


def check_documents(meta: dict[str, Any], data: str | Path) -> None:
    """Before launch, for ``train.document_mask``: every split records its document offsets."""
    missing = [name for name, split in meta.get("splits", {}).items() if "documents" not in split]
    if missing:
        raise DataError(f"train.document_mask = true needs document offsets, but dataset {str(data)!r} "
                        f"({', '.join(missing)}) has none recorded; prepare it again with hybridpar prepare")


def check_tokenizer(meta: dict[str, Any], data: str | Path, init_from: str | Path | None) -> None:
    """Before launch: a dataset that trains ``train.init_from``'s model must be tokenized with that
    model's tokenizer when its directory has a ``tokenizer.json`` (same sha256: ``prepare`` copies
    the file byte for byte). No ``init_from``, or no ``tokenizer.json`` there: nothing to check."""
    if not init_from:
        return
    from hybridpar.data.hf_tokenizer import directory_tokenizer_sha

    model_sha = directory_tokenizer_sha(init_from)
    if model_sha is None:
        return
    tok = meta.get("tokenizer") if isinstance(meta.get("tokenizer"), dict) else {}
    data_sha = tok.get("sha256")
    if data_sha == model_sha:
        return
    kind = tok.get("kind", "?")
    used = {"bytes": "the byte tokenizer", "bpe": "a BPE tokenizer trained by hybridpar prepare"}.get(
        kind, f"the tokenizer from {tok.get('source', '?')!r}")
    sha = f" (tokenizer.json sha256 {str(data_sha)[:12]}...)" if data_sha else ""
    raise TokenizerMismatchError(
        f"dataset {str(data)!r} was tokenized with {used}{sha}, not the tokenizer of --train.init_from "
        f"{str(init_from)!r} (tokenizer.json sha256 {model_sha[:12]}...); re-run hybridpar prepare --input ... "
        f"--tokenizer {init_from} --out DIR and train with --train.data DIR")


def verify_shard(path: Path, entry: dict[str, Any], dtype: np.dtype, vocab_size: int) -> None:
    """Raise unless ``path`` exists with the size, sha256 and id range that ``meta.json`` records.

    A match is remembered for this process, keyed by the file's stat; files modified in the last
    two seconds are never remembered (a same-tick rewrite would keep its stat)."""
    directory = path.parent
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DataNotFoundError(f"shard {str(path)!r} listed in {META_FILE} is missing; {_fix(directory)}") from None
    expected_size = int(entry["tokens"]) * dtype.itemsize
    if st.st_size != expected_size:
        raise DataError(f"shard {str(path)!r} holds {st.st_size} bytes, {META_FILE} expects {expected_size} "
                        f"({entry['tokens']} tokens x {dtype.itemsize} bytes); {_fix(directory)}")
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, entry["sha256"],
           vocab_size, dtype.str)
    if key in _VERIFIED:
        return
    h, top = hashlib.sha256(), -1
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            ids = np.frombuffer(chunk, dtype=dtype)
            if len(ids):
                top = max(top, int(ids.max()))
    actual = h.hexdigest()
    if actual != entry["sha256"]:
        raise DataError(f"shard {str(path)!r} is corrupt or modified: sha256 {actual[:16]}... != "
                        f"{str(entry['sha256'])[:16]}... recorded in {META_FILE}; {_fix(directory)}")
    if top >= vocab_size:
        raise DataError(f"shard {str(path)!r} holds token id {top} >= vocab_size {vocab_size} of {META_FILE}; "
                        f"{_fix(directory)}")
    if time.time() - st.st_mtime > 2.0:
        _VERIFIED.add(key)


def _split_array(directory: Path, entry: dict[str, Any], dtype: np.dtype) -> np.ndarray:
    parts = [np.memmap(directory / s["file"], dtype=dtype, mode="r", shape=(int(s["tokens"]),))
             for s in entry["shards"] if int(s["tokens"]) > 0]
    if not parts:
        return np.zeros(0, dtype=dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _verify_docs(directory: Path, entry: dict[str, Any]) -> None:
    docs = entry["documents"]
    path = directory / docs["file"]
    if not path.is_file():
        raise DataNotFoundError(f"document index {str(path)!r} listed in {META_FILE} is missing; {_fix(directory)}")
    size = int(docs["count"]) * DOCS_DTYPE.itemsize
    if path.stat().st_size != size or sha256_file(path) != docs["sha256"]:
        raise DataError(f"document index {str(path)!r} is corrupt or modified (size or sha256 differs from "
                        f"{META_FILE}); {_fix(directory)}")


def _docs_array(directory: Path, entry: dict[str, Any]) -> np.ndarray | None:
    docs = entry.get("documents")
    if not docs:
        return None
    n = int(docs["count"])
    if n == 0:
        return np.zeros(0, dtype=DOCS_DTYPE)
    return np.memmap(directory / docs["file"], dtype=DOCS_DTYPE, mode="r", shape=(n,))


def load_dataset(directory: str | Path, verify: bool = True) -> TokenSplits:
    """A prepared dataset: shards verified, each split a memory map (or, for several shards, one
    concatenated array), plus its tokenizer."""
    directory = Path(directory)
    meta = read_meta(directory)
    try:
        vocab = int(meta["vocab_size"])
        if meta["dtype"] not in DTYPES:
            raise DataError(f"{META_FILE} in {str(directory)!r} has dtype {meta['dtype']!r}, not one of "
                            f"{sorted(DTYPES)}; {_fix(directory)}")
        dtype = DTYPES[meta["dtype"]]
        splits = {name: meta["splits"][name] for name in SPLITS}
        tok_info = meta["tokenizer"]
        if verify:
            for entry in splits.values():
                for shard in entry["shards"]:
                    verify_shard(directory / shard["file"], shard, dtype, vocab)
            if tok_info.get("sha256"):
                tok_path = directory / tok_info["file"]
                if tok_path.is_file() and sha256_file(tok_path) != tok_info["sha256"]:
                    raise DataError(f"tokenizer {str(tok_path)!r} does not match the sha256 in {META_FILE}; "
                                    f"{_fix(directory)}")
            for entry in splits.values():
                if entry.get("documents"):
                    _verify_docs(directory, entry)
        tokenizer = load_tokenizer(tok_info, directory)
        arrays = {name: _split_array(directory, entry, dtype) for name, entry in splits.items()}
        docs = {name: _docs_array(directory, entry) for name, entry in splits.items()}
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{META_FILE} in {str(directory)!r} is malformed ({type(e).__name__}: {e}); "
                        f"{_fix(directory)}") from None
    if tokenizer.vocab_size > vocab:
        raise DataError(f"tokenizer vocabulary {tokenizer.vocab_size} > vocab_size {vocab} in {META_FILE}; "
                        f"{_fix(directory)}")
    return TokenSplits(train=arrays["train"], val=arrays["val"], vocab_size=vocab, source=str(directory),
                       tokenizer=tokenizer, meta=meta, train_docs=docs["train"], val_docs=docs["val"])
