"""``hybridpar prepare``: text, JSON Lines, Parquet, CSV or Arrow -> tokenized, checksummed,
memory-mappable shards.

Inputs are files or directories (see :mod:`hybridpar.data.readers` for the formats); a directory
is expanded recursively in sorted order, skipping names that start with a dot and anything inside
the output directory. A plain-text file is one document; a record of the other formats is one
document (its ``--text-field``). The last ``val_fraction`` of the documents (at least one, at
most all but one) is the validation split; a single document is split by tokens instead.

Framing: the byte and BPE tokenizers end each document with a blank line (``\\n\\n``, tokenized
with it); a Hugging Face tokenizer frames it as ``[BOS] text [EOS]`` (see
:mod:`hybridpar.data.hf_tokenizer`). ``meta.json`` records the framing, the tokenizer (its files
are copied into the dataset) and, per split, the start offset of every document.

Order of work: options, the tokenizer and what is cheap to check of every input (suffix, header
or schema, first record) are checked before anything is written. Then documents stream into a
hidden temporary directory, each file parsed once and each record checked as it is read: a reader
thread parses batches of text (about 8 Ki tokens per core), two encoder threads each hand one to the
tokenizer, which encodes it on all cores (``tokenizers``' own thread pool, the GIL released), and
the tokens are appended to one stream of shards closed as they fill. At the end the stream is cut
into the train and val splits (the val tail copied, the shard holding the cut truncated). A bad
record, found half-way, removes the temporary directory: bad input is still a one-line error and
no directory. Memory is bounded by the batches in flight, whatever the corpus size; plain-text
files over 4 MiB are encoded in pieces cut after a newline.

Atomicity: everything is written into a temporary sibling directory, ``meta.json`` last, and the
directory is renamed to ``--out`` only when complete. An interrupted run leaves at most a hidden
``.<name>.tmp-*`` sibling, never a directory that loads. Before the rename the directory and its
files get the modes a plain ``mkdir``/``open`` would (``0o777``/``0o666`` less the umask), not the
temporary directory's private 0700, so a dataset can be shared.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hybridpar.data.dataset import (
    DOCS_DTYPE,
    FORMAT,
    FORMAT_VERSION,
    META_FILE,
    ShardWriter,
    dtype_name,
    sha256_file,
    write_json,
)
from hybridpar.data.errors import DataError, DatasetExistsError
from hybridpar.data.hf_tokenizer import HFTokenizer
from hybridpar.data.readers import (
    Batch,
    Source,
    TextSource,
    expand_inputs,
    open_source,
    read_batches,
)
from hybridpar.data.tokenizer import (
    BYTE_VOCAB,
    DEFAULT_BPE_VOCAB,
    SEPARATOR,
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    Framing,
    Tokenizer,
    token_dtype,
)
from hybridpar.fsutil import publish_modes

__all__ = ["SEPARATOR", "cmd_prepare", "expand_inputs", "prepare_dataset"]

DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard
_PROGRESS_MIN_BYTES = 32 << 20
_CORES = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
# Tokens per encode_batch call: enough documents for every core (the tokenizer spreads a batch's
# documents over its threads), yet few, since the encoder's transient memory goes with the tokens
# in flight (about 100 bytes each, two batches at a time): 8 Ki per core, at least 16 Ki. The
# text per batch follows from the characters per token seen so far; BATCH_CHARS is the start
# (and stays the size for the byte tokenizer, whose memory is just its output).
BATCH_TOKENS = max(2, _CORES) << 13
BATCH_CHARS = 4 * BATCH_TOKENS
ENCODERS = 2
BATCH_DOCS = 4096


def _tokenizer_kind(tokenizer: str | Path) -> str:
    return str(tokenizer) if str(tokenizer) in ("bytes", "bpe") else "hf"


def _check_options(kind: str, vocab_size: int | None, val_fraction: float, shard_tokens: int,
                   bos: bool | None = None, eos: bool | None = None) -> int | None:
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction} must be between 0 and 1 (exclusive), e.g. 0.05")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens {shard_tokens} must be >= 1")
    if kind != "hf":
        for flag, value in (("--bos", bos), ("--eos", eos)):
            if value:
                raise DataError(f"{flag} needs a tokenizer with special tokens; --tokenizer {kind} has none (documents "
                                "end with a blank line): pass --tokenizer PATH or drop the flag")
    if kind == "hf":
        if vocab_size is not None:
            raise DataError(f"--vocab-size {vocab_size} does not apply to --tokenizer PATH (its vocabulary is the "
                            "file's); drop --vocab-size")
        return None
    if kind == "bytes":
        if vocab_size is not None and vocab_size != BYTE_VOCAB:
            raise DataError(f"--vocab-size {vocab_size} does not apply to --tokenizer bytes (its vocabulary is "
                            f"{BYTE_VOCAB}); drop --vocab-size or use --tokenizer bpe")
        return BYTE_VOCAB
    vocab = DEFAULT_BPE_VOCAB if vocab_size is None else vocab_size
    if vocab < BYTE_VOCAB:
        raise DataError(f"--vocab-size {vocab} is too small for bpe: it needs at least the {BYTE_VOCAB} byte "
                        f"symbols; use --vocab-size >= {BYTE_VOCAB}")
    token_dtype(vocab)  # raises if no dtype holds it
    return vocab


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise DatasetExistsError(f"--out {str(out)!r} is a file; pass a directory path")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise DatasetExistsError(f"--out {str(out)!r} exists and is not empty; pass --force to replace it "
                                 "or choose another directory")


def _install(tmp: Path, out: Path, force: bool) -> None:
    """Rename the finished ``tmp`` to ``out`` (replacing an existing ``out`` only with force)."""
    try:
        tmp.rename(out)  # atomic; succeeds over a missing or empty directory
        return
    except OSError:
        if not out.is_dir() or not force:
            raise DatasetExistsError(f"--out {str(out)!r} exists and is not empty (written meanwhile?); "
                                     "pass --force to replace it or choose another directory") from None
    trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    out.rename(trash / out.name)
    tmp.rename(out)
    shutil.rmtree(trash, ignore_errors=True)


def _version() -> str:
    import importlib.metadata  # here: it takes a noticeable part of the import time

    try:
        return importlib.metadata.version("hybridpar")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class _NoProgress:
    """What ``_progress`` returns when no bar is shown (tqdm is then not even imported)."""

    n = 0

    def update(self, n: int) -> None:
        pass

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total_bytes: int, enabled: bool) -> Any:
    """A bar over the input bytes (documents, tokens and tokens/s beside it), for inputs large
    enough to take a while."""
    if not enabled or total_bytes < _PROGRESS_MIN_BYTES:
        return _NoProgress()
    from tqdm import tqdm

    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="hybridpar prepare",
                file=sys.stderr)


_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _prefetch(items: Iterator[Any], depth: int, name: str) -> Iterator[Any]:
    """``items`` produced by a thread, ``depth`` ahead, so that stages overlap (parsing holds the
    GIL, encoding releases it while it runs on all cores); an exception in the thread is raised
    here. Closing this generator stops the thread, and the thread closes ``items``."""
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def put(x: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for x in items:
                if not put(x):
                    return
            put(_END)
        except BaseException as e:  # handed to the consumer
            put(_Failure(e))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=run, name=f"hybridpar-prepare-{name}", daemon=True)
    thread.start()
    try:
        while True:
            x = q.get()
            if x is _END:
                return
            if isinstance(x, _Failure):
                raise x.error
            yield x
    finally:
        stop.set()
        thread.join(timeout=10)


def _encode_one(framing: Framing, batch: Batch, dtype: np.dtype) -> tuple[Batch, np.ndarray, list[int]]:
    tokens, starts = framing.encode(batch.texts, batch.flags, dtype)
    batch.texts = []  # not needed any more: free it while the batch waits to be written
    return batch, tokens, starts


def _encoded(batches: Iterator[Batch], framing: Framing, dtype: np.dtype,
             workers: int = ENCODERS) -> Iterator[tuple[Batch, np.ndarray, list[int]]]:
    """Encoded batches, in order. ``workers`` threads each encode a batch at the same time: the
    tokenizer's thread pool then takes work from the next batch while the last documents of one
    finish, and framing (which holds the GIL) overlaps encoding (which does not)."""
    import collections
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(workers, thread_name_prefix="hybridpar-prepare-encoder")
    pending: collections.deque = collections.deque()
    try:
        for batch in batches:
            pending.append(pool.submit(_encode_one, framing, batch, dtype))
            if len(pending) > workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        close = getattr(batches, "close", None)
        if close is not None:
            close()  # stops the reader thread when we stop early


class _BatchChars:
    """Characters of text per batch for about ``tokens`` tokens each (None: a fixed size), from
    the characters per token seen so far, within 1/4 to 16 characters per token."""

    def __init__(self, tokens: int | None, first: int) -> None:
        self.tokens, self.chars, self._chars, self._tokens = tokens, first, 0, 0

    def __call__(self) -> int:
        return self.chars

    def observe(self, chars: int, tokens: int) -> None:
        self._chars += chars
        self._tokens += tokens
        if self.tokens and self._tokens:
            per_token = min(max(self._chars / self._tokens, 0.25), 16.0)
            self.chars = max(1, int(self.tokens * per_token))


def _resolve_tokenizer(tokenizer: str | Path, kind: str, bos: bool | None, eos: bool | None) -> HFTokenizer | None:
    return HFTokenizer.from_path(tokenizer).with_framing(bos, eos) if kind == "hf" else None


def prepare_dataset(
    inputs: Sequence[str | Path],
    out: str | Path,
    tokenizer: str | Path = "bytes",
    vocab_size: int | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    force: bool = False,
    progress: bool = False,
    text_field: str = "text",
    bos: bool | None = None,
    eos: bool | None = None,
    text_suffixes: Sequence[str] = (),
) -> dict[str, Any]:
    """Tokenize ``inputs`` into a dataset directory ``out``; returns its ``meta.json`` content.

    ``tokenizer``: ``bytes``, ``bpe`` (trained on the inputs, ``vocab_size``) or the path of a
    ``tokenizer.json`` / Hugging Face model directory. ``bos`` / ``eos``: frame documents with the
    tokenizer's BOS / EOS (None: its default). ``text_field``: the field / column of records.
    ``text_suffixes``: more suffixes read as plain text (e.g. ``.py``)."""
    kind = _tokenizer_kind(tokenizer)
    vocab = _check_options(kind, vocab_size, val_fraction, shard_tokens, bos, eos)
    out = Path(out)
    if not inputs:
        raise DataError("no inputs: pass text files or directories with --input PATH [PATH ...]")
    _check_out(out, force)
    hf = _resolve_tokenizer(tokenizer, kind, bos, eos)
    files = expand_inputs(inputs, exclude=out)
    if not files:
        raise DataError(f"no input files found under --input {' '.join(map(str, inputs))}; "
                        "pass text files or directories that contain some")
    sources = [open_source(p, text_field, text_suffixes) for p in files]
    needs_text = kind != "bytes"
    for src in sources:
        if isinstance(src, TextSource):
            src.tokenizer_name = kind
    sizes = [src.size() for src in sources]
    for src in sources:  # headers, schemas, first records: cheap; each record is checked as it is read
        src.check(needs_text)

    tok: Tokenizer
    if kind == "bpe":
        if progress:
            print(f"hybridpar prepare: training a BPE tokenizer (vocab {vocab}) on {len(sources)} inputs",
                  file=sys.stderr)

        def texts() -> Iterator[str]:
            for src in sources:
                for doc in src.documents(True):
                    if doc is not None:
                        yield str(doc) + SEPARATOR.decode()

        tok = BPETokenizer.train(texts(), vocab or DEFAULT_BPE_VOCAB)
    elif kind == "hf":
        assert hf is not None
        tok = hf
    else:
        tok = ByteTokenizer()
    vocab = tok.vocab_size
    dtype = token_dtype(vocab)
    framing = Framing(tok)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    whole = ShardWriter(tmp, "all", dtype, shard_tokens)
    empties: Any = None
    try:
        counts = [0] * len(sources)
        bar = _progress(sum(sizes), progress)
        tokens = records = 0
        t0 = time.perf_counter()
        batch_chars = _BatchChars(None if framing.bytes else BATCH_TOKENS, BATCH_CHARS)
        batches = read_batches(sources, sizes, needs_text, counts, batch_chars, BATCH_DOCS)
        stream = _encoded(_prefetch(batches, 4, "reader"), framing, dtype)
        with contextlib.closing(stream):
            for batch, array, starts in stream:
                if starts:
                    whole.add_documents(np.asarray(starts, dtype=np.int64) + whole.total)
                whole.write(array)
                if batch.empty:
                    if empties is None:
                        empties = open(tmp / _EMPTY_FILE, "wb")  # noqa: SIM115 (closed below / on error)
                    np.asarray(batch.empty, dtype="<i8").tofile(empties)
                tokens += len(array)
                records = batch.records
                batch_chars.observe(batch.chars, len(array))
                bar.update(batch.done - bar.n)
                bar.set_postfix(docs=records, tokens=tokens,
                                tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.3g}", refresh=False)
        bar.close()
        if empties is not None:
            empties.close()
        n_docs = sum(counts)
        if n_docs == 0:
            shown = ", ".join(repr(str(p)) for p in files[:3]) + (", ..." if len(files) > 3 else "")
            if all(isinstance(s, TextSource) for s in sources):
                raise DataError(f"all {len(files)} input files are empty ({shown}); pass files that contain text")
            raise DataError(f"empty corpus: the {len(files)} inputs ({shown}) hold no documents; pass inputs that "
                            "contain text")
        n_val = min(max(1, int(n_docs * val_fraction)), n_docs - 1) if n_docs > 1 else 0
        first_val = n_docs - n_val
        splits = _split(tmp, whole.close(), dtype, shard_tokens, val_fraction, first_val if n_val else None, files)
        if not splits["train"]["tokens"]:
            raise DataError(f"empty corpus: the inputs' {n_docs} records hold no text; pass inputs that contain text")
        tok_info: dict[str, Any] = {"kind": tok.kind, "vocab_size": vocab}
        if isinstance(tok, BPETokenizer):
            tok.save(tmp / TOKENIZER_FILE)
            tok_info.update(file=TOKENIZER_FILE, sha256=sha256_file(tmp / TOKENIZER_FILE))
        elif isinstance(tok, HFTokenizer):
            tok.save(tmp)
            tok_info = tok.info()
        sources_meta = _sources_meta(sources, sizes, counts, first_val, n_val)
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "created_by": f"hybridpar {_version()}",
            "tokenizer": tok_info, "vocab_size": vocab, "dtype": dtype_name(dtype), "byteorder": "little",
            "document_separator": framing.separator, "framing": framing.meta(), "text_field": text_field,
            "val_fraction": val_fraction, "shard_tokens": shard_tokens, "documents": n_docs,
            "tokens": {s: e["tokens"] for s, e in splits.items()}, "splits": splits, "sources": sources_meta,
        }
        write_json(tmp / META_FILE, meta)  # last: its presence marks a complete dataset
        publish_modes(tmp)  # mkdtemp made it 0700: give it the modes a plain mkdir/open would
        _install(tmp, out, force)
    except BaseException:
        whole.abort()
        if empties is not None:
            empties.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


_EMPTY_FILE = "empty-records.tmp"  # global indices of empty records, while writing (removed by _split)
_COPY = 1 << 19  # tokens or document offsets per copy in _split (a few MiB): bounded memory


def _split(tmp: Path, whole: dict[str, Any], dtype: np.dtype, shard_tokens: int, val_fraction: float,
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
        empty_path = tmp / _EMPTY_FILE
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


def _sources_meta(sources: list[Source], sizes: list[int], counts: list[int], first_val: int,
                  n_val: int) -> list[dict[str, Any]]:
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hybridpar prepare",
        description="Tokenize text, JSON Lines, Parquet, CSV or Arrow (datasets' save_to_disk) inputs into "
        "memory-mapped token shards for --train.data DIR. Directories are read recursively in sorted order; a "
        "text file is one document, a record of the other formats is one document.")
    p.add_argument("--input", nargs="*", default=[], metavar="PATH",
                   help=".txt/.md, .jsonl/.json (also .gz/.zst), .parquet, .csv (also .gz/.zst), .arrow, "
                   "save_to_disk directories, or directories holding them")
    p.add_argument("--out", required=True, metavar="DIR", help="dataset directory to create")
    p.add_argument("--tokenizer", default="bytes", metavar="bytes|bpe|PATH",
                   help="bytes: one token per byte (vocab 256, any bytes); bpe: byte-level BPE trained on the "
                   "inputs with Hugging Face tokenizers (needs UTF-8); PATH: a tokenizer.json or a Hugging Face "
                   "model directory (its tokenizer.json, tokenizer_config.json give BOS/EOS)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the field (JSON Lines) or column (Parquet, CSV, Arrow) that holds the text (default text)")
    p.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None,
                   help="start each document with the tokenizer's BOS token (default: as its tokenizer_config.json "
                   "says, when it has one that differs from EOS)")
    p.add_argument("--eos", action=argparse.BooleanOptionalAction, default=None,
                   help="end each document with the tokenizer's EOS token (default: when it has one)")
    p.add_argument("--text-suffix", action="append", default=[], metavar="SUFFIX",
                   help="also read files with this suffix as plain text, e.g. .py (repeatable)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help=f"BPE vocabulary size (default {DEFAULT_BPE_VOCAB}; at least {BYTE_VOCAB})")
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                   help=f"fraction of documents for validation (default {DEFAULT_VAL_FRACTION})")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                   help=f"tokens per shard file (default {DEFAULT_SHARD_TOKENS})")
    p.add_argument("--force", action="store_true", help="replace an existing non-empty --out directory")
    return p


def cmd_prepare(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    meta = prepare_dataset(args.input, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                           val_fraction=args.val_fraction, shard_tokens=args.shard_tokens, force=args.force,
                           progress=True, text_field=args.text_field, bos=args.bos, eos=args.eos,
                           text_suffixes=args.text_suffix)
    n_shards = sum(len(e["shards"]) for e in meta["splits"].values())
    tok = meta["tokenizer"]
    name = tok.get("source", tok["kind"]) if tok["kind"] == "hf" else tok["kind"]
    print(f"hybridpar: prepared {args.out}: {meta['tokens']['train']} train + {meta['tokens']['val']} val tokens "
          f"from {meta['documents']} documents in {len(meta['sources'])} files, tokenizer {name} (vocab "
          f"{meta['vocab_size']}), {meta['dtype']}, {n_shards} shards; train with --train.data {args.out} "
          f"--model.vocab_size >= {meta['vocab_size']}")
    return 0
