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

Order of work: options, tokenizer and every input are checked (each file read once, records
counted) before anything is written, so bad input is a one-line error and no directory. Then
documents stream: a reader thread parses batches of about 1 MiB of text, the tokenizer encodes
each batch on all cores (``tokenizers``' own thread pool, the GIL released), and tokens are
appended to shards that are closed as they fill. Memory is bounded by the batch size, whatever
the corpus size; plain-text files over 4 MiB are encoded in pieces cut after a newline.

Atomicity: everything is written into a temporary sibling directory, ``meta.json`` last, and the
directory is renamed to ``--out`` only when complete. An interrupted run leaves at most a hidden
``.<name>.tmp-*`` sibling, never a directory that loads. Before the rename the directory and its
files get the modes a plain ``mkdir``/``open`` would (``0o777``/``0o666`` less the umask), not the
temporary directory's private 0700, so a dataset can be shared.
"""

from __future__ import annotations

import argparse
import importlib.metadata
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
from hybridpar.data.readers import Source, TextSource, expand_inputs, open_source, scan_all
from hybridpar.data.tokenizer import (
    BYTE_VOCAB,
    DEFAULT_BPE_VOCAB,
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    token_dtype,
)
from hybridpar.fsutil import publish_modes

__all__ = ["SEPARATOR", "cmd_prepare", "expand_inputs", "prepare_dataset"]

SEPARATOR = b"\n\n"
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard
_PROGRESS_MIN_BYTES = 32 << 20
BATCH_CHARS = 1 << 20  # text per encode_batch call: enough for every core, small enough to bound memory
BATCH_DOCS = 4096
PIECE_CHARS = 4 << 20  # plain-text documents longer than this are encoded in pieces


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
    try:
        return importlib.metadata.version("hybridpar")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _progress(total_docs: int, total_bytes: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total_docs, unit="doc", unit_scale=True, desc="hybridpar prepare", file=sys.stderr,
                disable=not enabled or total_bytes < _PROGRESS_MIN_BYTES)


class _Framing:
    """How documents become token arrays: optional BOS / EOS ids, or a separator text appended."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.bytes = isinstance(tok, ByteTokenizer)
        self.bos = tok.bos_id if isinstance(tok, HFTokenizer) and tok.add_bos else None
        self.eos = tok.eos_id if isinstance(tok, HFTokenizer) and tok.add_eos else None
        self.separator = SEPARATOR.decode() if self.bos is None and self.eos is None else ""

    def meta(self) -> dict[str, Any]:
        return {"bos_id": self.bos, "eos_id": self.eos, "separator": self.separator}

    def encode(self, items: list[tuple[int, Any, bool, bool]], dtype: np.dtype) -> list[np.ndarray]:
        """Token arrays of (index, text, first piece, last piece) items."""
        if self.bytes:
            sep = self.separator.encode()
            return [np.frombuffer((t if isinstance(t, bytes) else t.encode("utf-8")) + (sep if last else b""),
                                  dtype=np.uint8).astype(dtype) for _, t, _, last in items]
        texts = [t + self.separator if last else t for _, t, _, last in items]
        out = []
        for (_, _, first, last), ids in zip(items, self.tok.encode_batch(texts), strict=True):  # type: ignore[attr-defined]
            head = int(first and self.bos is not None)
            tail = int(last and self.eos is not None)
            arr = np.empty(head + len(ids) + tail, dtype=dtype)
            if head:
                arr[0] = self.bos
            arr[head : head + len(ids)] = ids
            if tail:
                arr[-1] = self.eos
            out.append(arr)
        return out


def _pieces(text: Any) -> Iterator[Any]:
    """A long plain-text document in pieces of about PIECE_CHARS, cut after a newline that is not
    followed by more whitespace (so pre-tokenizers that split at whitespace see the same words)."""
    n, pos = len(text), 0
    nl = b"\n" if isinstance(text, bytes) else "\n"
    while n - pos > PIECE_CHARS:
        cut = text.find(nl, pos + PIECE_CHARS)
        while cut != -1 and cut + 1 < n and text[cut + 1 : cut + 2].isspace():
            cut = text.find(nl, cut + 1)
        if cut == -1 or cut + 1 >= n:
            break
        yield text[pos : cut + 1]
        pos = cut + 1
    yield text[pos:]


def _batches(sources: list[Source], needs_text: bool) -> Iterator[list[tuple[int, Any, bool, bool]]]:
    """(global record index, text, first piece, last piece) in batches of about BATCH_CHARS."""
    batch: list[tuple[int, Any, bool, bool]] = []
    size, index = 0, 0
    for src in sources:
        for doc in src.documents(needs_text):
            if doc is not None:
                pieces = list(_pieces(doc)) if isinstance(src, TextSource) and len(doc) > PIECE_CHARS else [doc]
                for k, piece in enumerate(pieces):
                    batch.append((index, piece, k == 0, k == len(pieces) - 1))
                    size += len(piece)
                    if size >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
                        yield batch
                        batch, size = [], 0
            index += 1
    if batch:
        yield batch


_END = object()


def _prefetch(items: Iterator[Any], depth: int = 4) -> Iterator[Any]:
    """``items`` produced by a reader thread, ``depth`` ahead (parsing overlaps encoding, which
    releases the GIL); an exception in the thread is raised here."""
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

    thread = threading.Thread(target=run, name="hybridpar-prepare-reader", daemon=True)
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


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


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
    counts = scan_all(sources, needs_text)  # every record checked before anything is written
    n_docs = sum(counts)
    if n_docs == 0:
        shown = ", ".join(repr(str(p)) for p in files[:3]) + (", ..." if len(files) > 3 else "")
        if all(isinstance(s, TextSource) for s in sources):
            raise DataError(f"all {len(files)} input files are empty ({shown}); pass files that contain text")
        raise DataError(f"empty corpus: the {len(files)} inputs ({shown}) hold no documents; pass inputs that "
                        "contain text")
    n_val = min(max(1, int(n_docs * val_fraction)), n_docs - 1) if n_docs > 1 else 0
    first_val = n_docs - n_val

    tok: Tokenizer
    if kind == "bpe":
        if progress:
            print(f"hybridpar prepare: training a BPE tokenizer (vocab {vocab}) on {n_docs} documents", file=sys.stderr)

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
    framing = _Framing(tok)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    names = ("train", "val") if n_val else ("all",)
    writers = {s: ShardWriter(tmp, s, dtype, shard_tokens if n_val else 1 << 62) for s in names}
    try:
        bar = _progress(n_docs, sum(sizes), progress)
        tokens, t0 = 0, time.perf_counter()
        for batch in _prefetch(_batches(sources, needs_text)):
            arrays = framing.encode(batch, dtype)
            done = 0
            for (index, _, first, last), arr in zip(batch, arrays, strict=True):
                split = "all" if not n_val else ("val" if index >= first_val else "train")
                if first:
                    writers[split].add_documents([writers[split].total])
                writers[split].write(arr)
                tokens += len(arr)
                done += int(last)
            bar.update(done)
            bar.set_postfix(tokens=tokens, tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.3g}", refresh=False)
        bar.close()
        if not n_val:
            splits = _split_single(tmp, writers["all"], dtype, shard_tokens, val_fraction, files)
        else:
            splits = {s: w.close() for s, w in writers.items()}
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
        for w in writers.values():
            w.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _split_single(tmp: Path, whole: ShardWriter, dtype: np.dtype, shard_tokens: int, val_fraction: float,
                  files: list[Path]) -> dict[str, Any]:
    """One document: its last ``val_fraction`` of tokens (at least one) is the validation split."""
    entry = whole.close()
    n = entry["tokens"]
    cut = n - max(1, int(n * val_fraction))
    if cut < 1:
        raise DataError(f"input {str(files[0])!r} gives only {n} tokens; a single input needs at least 2 (one "
                        "train, one validation); pass more text")
    writers = {s: ShardWriter(tmp, s, dtype, shard_tokens) for s in ("train", "val")}
    path = tmp / entry["shards"][0]["file"]
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    step = 1 << 24
    for split, lo, hi in (("train", 0, cut), ("val", cut, n)):
        writers[split].add_documents([0])
        for pos in range(lo, hi, step):
            writers[split].write(np.asarray(tokens[pos : min(pos + step, hi)]))
    del tokens
    path.unlink()
    (tmp / whole.docs_file).unlink(missing_ok=True)
    return {s: w.close() for s, w in writers.items()}


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
