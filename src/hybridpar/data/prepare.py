"""``hybridpar prepare``: text files -> tokenized, checksummed, memory-mappable shards.

Inputs are files or directories; a directory is expanded recursively in sorted order, skipping
names that start with a dot (``.git`` and the like) and anything inside the output directory.
Each non-empty file is one document, tokenized as its bytes followed by a blank line (``\\n\\n``).
Empty files are listed in ``meta.json`` and otherwise skipped. The last ``val_fraction`` of the
documents (at least one, at most all but one) is the validation split; a single document is
split by tokens instead.

Atomicity: everything is written into a temporary sibling directory, ``meta.json`` last, and the
directory is renamed to ``--out`` only when complete. An interrupted run leaves at most a hidden
``.<name>.tmp-*`` sibling, never a directory that loads. Before the rename the directory and its
files get the modes a plain ``mkdir``/``open`` would (``0o777``/``0o666`` less the umask), not the
temporary directory's private 0700, so a dataset can be shared.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hybridpar.data.dataset import (
    FORMAT,
    FORMAT_VERSION,
    META_FILE,
    ShardWriter,
    dtype_name,
    sha256_file,
    write_json,
)
from hybridpar.data.errors import DataError, DataNotFoundError, DatasetExistsError
from hybridpar.data.tokenizer import (
    BYTE_VOCAB,
    DEFAULT_BPE_VOCAB,
    TOKENIZER_FILE,
    BPETokenizer,
    ByteTokenizer,
    Tokenizer,
    token_dtype,
    utf8_text,
)
from hybridpar.fsutil import publish_modes

SEPARATOR = b"\n\n"
DEFAULT_VAL_FRACTION = 0.05
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB of uint16 per shard
_PROGRESS_MIN_BYTES = 32 << 20


def expand_inputs(inputs: Sequence[str | Path], exclude: Path | None = None) -> list[Path]:
    """Files named by ``inputs`` in a deterministic order (directories recursively, sorted)."""
    out: list[Path] = []
    seen: set[Path] = set()
    skip = exclude.resolve() if exclude is not None else None
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise DataNotFoundError(f"input {str(path)!r} does not exist; pass existing files or directories to --input")
        if path.is_dir():
            found = sorted(
                (p for p in path.rglob("*") if p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)),
                key=lambda p: p.relative_to(path).as_posix())
        else:
            found = [path]
        for p in found:
            resolved = p.resolve()
            if resolved in seen or (skip is not None and resolved.is_relative_to(skip)):
                continue
            seen.add(resolved)
            out.append(p)
    return out


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read input {str(path)!r}: {e.strerror or e}; fix its permissions or leave it "
                        "out of --input") from None


def _check_options(kind: str, vocab_size: int | None, val_fraction: float, shard_tokens: int) -> int:
    if kind not in ("bytes", "bpe"):
        raise DataError(f"--tokenizer {kind!r} is unknown; choose bytes or bpe")
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"--val-fraction {val_fraction} must be between 0 and 1 (exclusive), e.g. 0.05")
    if shard_tokens < 1:
        raise DataError(f"--shard-tokens {shard_tokens} must be >= 1")
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


def _progress(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="hybridpar prepare", file=sys.stderr,
                disable=not enabled or total < _PROGRESS_MIN_BYTES)


def prepare_dataset(
    inputs: Sequence[str | Path],
    out: str | Path,
    tokenizer: str = "bytes",
    vocab_size: int | None = None,
    val_fraction: float = DEFAULT_VAL_FRACTION,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    force: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Tokenize ``inputs`` into a dataset directory ``out``; returns its ``meta.json`` content."""
    vocab = _check_options(tokenizer, vocab_size, val_fraction, shard_tokens)
    out = Path(out)
    if not inputs:
        raise DataError("no inputs: pass text files or directories with --input PATH [PATH ...]")
    _check_out(out, force)
    files = expand_inputs(inputs, exclude=out)
    if not files:
        raise DataError(f"no input files found under --input {' '.join(map(str, inputs))}; "
                        "pass text files or directories that contain some")
    sizes = []
    for p in files:
        try:
            sizes.append(p.stat().st_size)
        except OSError as e:
            raise DataError(f"cannot read input {str(p)!r}: {e.strerror or e}; fix it or leave it out of --input") from None
    docs = [p for p, n in zip(files, sizes, strict=True) if n > 0]
    if not docs:
        shown = ", ".join(repr(str(p)) for p in files[:3]) + (", ..." if len(files) > 3 else "")
        raise DataError(f"all {len(files)} input files are empty ({shown}); pass files that contain text")
    n_val = min(max(1, int(len(docs) * val_fraction)), len(docs) - 1) if len(docs) > 1 else 0
    val_docs = set(docs[len(docs) - n_val :])

    tok: Tokenizer
    if tokenizer == "bpe":
        if progress:
            print(f"hybridpar prepare: training a BPE tokenizer (vocab {vocab}) on {len(docs)} files", file=sys.stderr)

        def texts() -> Iterator[str]:
            for p in docs:
                yield utf8_text(_read(p), str(p)) + SEPARATOR.decode()

        tok = BPETokenizer.train(texts(), vocab)
    else:
        tok = ByteTokenizer()
    vocab = tok.vocab_size
    dtype = token_dtype(vocab)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    writers = {s: ShardWriter(tmp, s, dtype, shard_tokens) for s in ("train", "val")}
    try:
        sources = []
        bar = _progress(sum(sizes), progress)
        for path, size in zip(files, sizes, strict=True):
            if size == 0:
                sources.append({"path": str(path), "bytes": 0, "split": None})
                continue
            data = _read(path)
            ids = tok.encode_document(data + SEPARATOR, str(path))
            if n_val == 0:  # one document: its last tokens are the validation split
                cut = len(ids) - max(1, int(len(ids) * val_fraction))
                if cut < 1:
                    raise DataError(f"input {str(path)!r} gives only {len(ids)} tokens; a single input needs at "
                                    "least 2 (one train, one validation); pass more text")
                writers["train"].write(ids[:cut])
                writers["val"].write(ids[cut:])
                split = "train+val"
            else:
                split = "val" if path in val_docs else "train"
                writers[split].write(ids)
            sources.append({"path": str(path), "bytes": len(data), "split": split})
            bar.update(size)
        bar.close()
        splits = {s: w.close() for s, w in writers.items()}
        tok_info: dict[str, Any] = {"kind": tok.kind, "vocab_size": vocab}
        if isinstance(tok, BPETokenizer):
            tok.save(tmp / TOKENIZER_FILE)
            tok_info.update(file=TOKENIZER_FILE, sha256=sha256_file(tmp / TOKENIZER_FILE))
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "created_by": f"hybridpar {_version()}",
            "tokenizer": tok_info, "vocab_size": vocab, "dtype": dtype_name(dtype), "byteorder": "little",
            "document_separator": SEPARATOR.decode(), "val_fraction": val_fraction, "shard_tokens": shard_tokens,
            "tokens": {s: e["tokens"] for s, e in splits.items()}, "splits": splits, "sources": sources,
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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hybridpar prepare",
        description="Tokenize text files into memory-mapped token shards for --train.data DIR. Directories are "
        "read recursively in sorted order; each file is one document.")
    p.add_argument("--input", nargs="*", default=[], metavar="PATH", help="text files or directories")
    p.add_argument("--out", required=True, metavar="DIR", help="dataset directory to create")
    p.add_argument("--tokenizer", choices=("bytes", "bpe"), default="bytes",
                   help="bytes: one token per byte (vocab 256, any bytes); bpe: byte-level BPE trained on the "
                   "inputs with Hugging Face tokenizers (needs UTF-8)")
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
                           progress=True)
    n_shards = sum(len(e["shards"]) for e in meta["splits"].values())
    print(f"hybridpar: prepared {args.out}: {meta['tokens']['train']} train + {meta['tokens']['val']} val tokens "
          f"from {len(meta['sources'])} files, tokenizer {meta['tokenizer']['kind']} (vocab {meta['vocab_size']}), "
          f"{meta['dtype']}, {n_shards} shards; train with --train.data {args.out} --model.vocab_size "
          f">= {meta['vocab_size']}")
    return 0
