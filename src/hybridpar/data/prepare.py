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

The steps live beside this module: :mod:`hybridpar.data.readers` (inputs and batches),
:mod:`hybridpar.data.stream` (the reader and encoder threads, the progress bar) and
:mod:`hybridpar.data.splits` (the cut into train and val).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
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
from hybridpar.data.readers import expand_inputs, open_source, read_batches
from hybridpar.data.sources import Source, TextSource
from hybridpar.data.splits import EMPTY_FILE, sources_meta, split_stream
from hybridpar.data.stream import BatchChars, encoded, prefetch, progress_bar
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
_CORES = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
# Tokens per encode_batch call: enough documents for every core (the tokenizer spreads a batch's
# documents over its threads), yet few, since the encoder's transient memory goes with the tokens
# in flight (about 100 bytes each, two batches at a time): 8 Ki per core, at least 16 Ki. The
# text per batch follows from the characters per token seen so far; BATCH_CHARS is the start
# (and stays the size for the byte tokenizer, whose memory is just its output).
BATCH_TOKENS = max(2, _CORES) << 13
BATCH_CHARS = 4 * BATCH_TOKENS
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


def _resolve_tokenizer(tokenizer: str | Path, kind: str, bos: bool | None, eos: bool | None) -> HFTokenizer | None:
    return HFTokenizer.from_path(tokenizer).with_framing(bos, eos) if kind == "hf" else None


def _open_sources(inputs: Sequence[str | Path], out: Path, kind: str, text_field: str,
                  text_suffixes: Sequence[str]) -> tuple[list[Path], list[Source], list[int]]:
    """The input files, their readers and sizes, each checked where that is cheap (headers,
    schemas, first records) before anything is written; each record is checked as it is read."""
    files = expand_inputs(inputs, exclude=out)
    if not files:
        raise DataError(f"no input files found under --input {' '.join(map(str, inputs))}; "
                        "pass text files or directories that contain some")
    sources = [open_source(p, text_field, text_suffixes) for p in files]
    for src in sources:
        if isinstance(src, TextSource):
            src.tokenizer_name = kind
    sizes = [src.size() for src in sources]
    for src in sources:
        src.check(kind != "bytes")
    return files, sources, sizes


def _make_tokenizer(kind: str, vocab: int | None, hf: HFTokenizer | None, sources: list[Source],
                    progress: bool) -> Tokenizer:
    """The tokenizer of ``kind``: BPE trained on the sources' documents, the resolved Hugging Face
    one, or bytes."""
    if kind == "bpe":
        if progress:
            print(f"hybridpar prepare: training a BPE tokenizer (vocab {vocab}) on {len(sources)} inputs",
                  file=sys.stderr)

        def texts() -> Iterator[str]:
            for src in sources:
                for doc in src.documents(True):
                    if doc is not None:
                        yield str(doc) + SEPARATOR.decode()

        return BPETokenizer.train(texts(), vocab or DEFAULT_BPE_VOCAB)
    if kind == "hf":
        assert hf is not None
        return hf
    return ByteTokenizer()


def _write_stream(tmp: Path, whole: ShardWriter, sources: list[Source], sizes: list[int], needs_text: bool,
                  framing: Framing, dtype: np.dtype, progress: bool) -> list[int]:
    """Stream every source's documents through reader and encoder threads into ``whole`` (one
    token stream, cut into splits at the end); the global indices of empty records go to
    ``EMPTY_FILE``. Returns each source's record count."""
    counts = [0] * len(sources)
    bar = progress_bar(sum(sizes), progress)
    tokens = records = 0
    t0 = time.perf_counter()
    batch_chars = BatchChars(None if framing.bytes else BATCH_TOKENS, BATCH_CHARS)
    batches = read_batches(sources, sizes, needs_text, counts, batch_chars, BATCH_DOCS)
    stream = encoded(prefetch(batches, 4, "reader"), framing, dtype)
    empties: Any = None
    try:
        with contextlib.closing(stream):
            for batch, array, starts in stream:
                if starts:
                    whole.add_documents(np.asarray(starts, dtype=np.int64) + whole.total)
                whole.write(array)
                if batch.empty:
                    if empties is None:
                        empties = open(tmp / EMPTY_FILE, "wb")  # noqa: SIM115 (closed below)
                    np.asarray(batch.empty, dtype="<i8").tofile(empties)
                tokens += len(array)
                records = batch.records
                batch_chars.observe(batch.chars, len(array))
                bar.update(batch.done - bar.n)
                bar.set_postfix(docs=records, tokens=tokens,
                                tok_s=f"{tokens / max(time.perf_counter() - t0, 1e-9):.3g}", refresh=False)
        bar.close()
    finally:
        if empties is not None:
            empties.close()
    return counts


def _split(tmp: Path, whole: ShardWriter, dtype: np.dtype, files: list[Path], sources: list[Source], sizes: list[int],
           counts: list[int], shard_tokens: int, val_fraction: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The train and val splits of the written stream (the last ``val_fraction`` of the
    documents, at least one, at most all but one) and each source's entry in ``meta.json``."""
    n_docs = sum(counts)
    if n_docs == 0:
        shown = ", ".join(repr(str(p)) for p in files[:3]) + (", ..." if len(files) > 3 else "")
        if all(isinstance(s, TextSource) for s in sources):
            raise DataError(f"all {len(files)} input files are empty ({shown}); pass files that contain text")
        raise DataError(f"empty corpus: the {len(files)} inputs ({shown}) hold no documents; pass inputs that "
                        "contain text")
    n_val = min(max(1, int(n_docs * val_fraction)), n_docs - 1) if n_docs > 1 else 0
    first_val = n_docs - n_val
    splits = split_stream(tmp, whole.close(), dtype, shard_tokens, val_fraction, first_val if n_val else None, files)
    if not splits["train"]["tokens"]:
        raise DataError(f"empty corpus: the inputs' {n_docs} records hold no text; pass inputs that contain text")
    return splits, sources_meta(sources, sizes, counts, first_val, n_val)


def _save_tokenizer(tok: Tokenizer, tmp: Path) -> dict[str, Any]:
    """Copy a trained or Hugging Face tokenizer into the dataset; its ``meta.json`` entry."""
    tok_info: dict[str, Any] = {"kind": tok.kind, "vocab_size": tok.vocab_size}
    if isinstance(tok, BPETokenizer):
        tok.save(tmp / TOKENIZER_FILE)
        tok_info.update(file=TOKENIZER_FILE, sha256=sha256_file(tmp / TOKENIZER_FILE))
    elif isinstance(tok, HFTokenizer):
        tok.save(tmp)
        tok_info = tok.info()
    return tok_info


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
    files, sources, sizes = _open_sources(inputs, out, kind, text_field, text_suffixes)
    tok = _make_tokenizer(kind, vocab, hf, sources, progress)
    vocab, framing = tok.vocab_size, Framing(tok)
    dtype = token_dtype(vocab)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    whole = ShardWriter(tmp, "all", dtype, shard_tokens)
    try:
        counts = _write_stream(tmp, whole, sources, sizes, kind != "bytes", framing, dtype, progress)
        splits, sources_entries = _split(tmp, whole, dtype, files, sources, sizes, counts, shard_tokens, val_fraction)
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "created_by": f"hybridpar {_version()}",
            "tokenizer": _save_tokenizer(tok, tmp), "vocab_size": vocab, "dtype": dtype_name(dtype),
            "byteorder": "little", "document_separator": framing.separator, "framing": framing.meta(),
            "text_field": text_field, "val_fraction": val_fraction, "shard_tokens": shard_tokens,
            "documents": sum(counts), "tokens": {s: e["tokens"] for s, e in splits.items()}, "splits": splits,
            "sources": sources_entries,
        }
        write_json(tmp / META_FILE, meta)  # last: its presence marks a complete dataset
        publish_modes(tmp)  # mkdtemp made it 0700: give it the modes a plain mkdir/open would
        _install(tmp, out, force)
    except BaseException:
        whole.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


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
