"""Input formats of ``hybridpar prepare``: each input is a :class:`Source` whose ``check`` looks at
what is cheap to look at up front (its header, schema or first record) and whose ``documents``
then yields every record's text in order, streaming, validating each record as it is read (so a
file is parsed once, and memory stays bounded whatever its size). ``prepare`` writes into a hidden
temporary directory that is removed when a record fails, so bad input never leaves a directory.

=====================  ===================================================================
plain text             ``.txt``, ``.md`` (and suffixes passed as ``text_suffixes``): one file
                       is one document
JSON Lines             ``.jsonl``, ``.json`` (one object per line, the text in ``text_field``),
                       also compressed ``.gz`` / ``.zst``
Parquet                ``.parquet`` (column ``text_field``), read by record batches
CSV                    ``.csv`` (column ``text_field``, header row), also ``.gz`` / ``.zst``
Arrow                  a directory written by ``datasets.Dataset.save_to_disk`` (its ``*.arrow``
                       IPC streams, in the order ``state.json`` lists), or one ``.arrow`` file
=====================  ===================================================================

Readers: pyarrow for Parquet, CSV, Arrow and every decompression (``pa.input_stream`` detects
``.gz`` / ``.zst``); JSON Lines with the standard ``json`` module line by line, which names the
line of a malformed record (pyarrow's JSON reader names no line and, before pyarrow 19, reads a
whole file into memory). A record whose text is empty or null yields ``None`` (no document).

Anything else is an error naming the file and these formats, never tokenized as bytes: an
unknown suffix, binary content in a text file (NUL bytes, or the magic number of a compressed or
columnar file), a compressed file whose name does not say so.

The readers are :mod:`hybridpar.data.sources` (the :class:`Source` interface, plain text, JSON
Lines) and :mod:`hybridpar.data.columnar` (Parquet, CSV, Arrow); this module picks one by suffix.

``read_batches`` groups the documents of all sources into the batches ``prepare`` encodes. Its
progress: ``Source.done`` counts the input bytes consumed where a reader knows it cheaply
(uncompressed JSON Lines, line by line); the other formats count whole files.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from hybridpar.data.columnar import ArrowSource, CsvSource, ParquetSource
from hybridpar.data.errors import DataError, DataNotFoundError
from hybridpar.data.sources import FORMATS, JsonlSource, Source, TextSource

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".json")
COMPRESSED = (".gz", ".zst")
ARROW_DIR_MARKERS = ("state.json", "dataset_info.json")
DATASET_DICT_FILE = "dataset_dict.json"


def is_arrow_dir(path: Path) -> bool:
    """A directory written by ``datasets.Dataset.save_to_disk``: ``*.arrow`` plus its state file."""
    return path.is_dir() and any((path / m).is_file() for m in ARROW_DIR_MARKERS) and any(path.glob("*.arrow"))


def expand_inputs(inputs: Sequence[str | Path], exclude: Path | None = None) -> list[Path]:
    """Inputs in a deterministic order: files as given, directories recursively in sorted order
    (names starting with a dot and anything inside ``exclude`` skipped); a ``save_to_disk``
    directory is one input, and a ``DatasetDict``'s ``dataset_dict.json`` is skipped."""
    out: list[Path] = []
    seen: set[Path] = set()
    skip = exclude.resolve() if exclude is not None else None
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise DataNotFoundError(f"input {str(path)!r} does not exist; pass existing files or directories to --input")
        found = _walk(path) if path.is_dir() and not is_arrow_dir(path) else [path]
        for p in found:
            resolved = p.resolve()
            if resolved in seen or (skip is not None and (resolved == skip or resolved.is_relative_to(skip))):
                continue
            seen.add(resolved)
            out.append(p)
    return out


def _walk(root: Path) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for d in list(dirnames):
            if is_arrow_dir(here / d):
                found.append(here / d)
                dirnames.remove(d)
        dict_root = DATASET_DICT_FILE in filenames
        for name in filenames:
            if name.startswith(".") or (dict_root and name == DATASET_DICT_FILE):
                continue
            found.append(here / name)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _suffix(path: Path) -> tuple[str, str]:
    """(format suffix, compression suffix or ''): ``a.jsonl.gz`` -> ('.jsonl', '.gz')."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSED:
        return (suffixes[-2] if len(suffixes) > 1 else ""), suffixes[-1]
    return (suffixes[-1] if suffixes else ""), ""


def open_source(path: Path, text_field: str = "text", text_suffixes: Sequence[str] = ()) -> Source:
    """The reader for ``path`` by its suffix (or as a ``save_to_disk`` directory)."""
    text_ok = {*TEXT_SUFFIXES, *(s.lower() if s.startswith(".") else f".{s.lower()}" for s in text_suffixes)}
    if path.is_dir():
        if is_arrow_dir(path):
            return ArrowSource(path, text_field)
        raise DataError(f"input {str(path)!r} is a directory but not one written by datasets' save_to_disk; "
                        f"hybridpar prepare reads {FORMATS}")
    fmt, comp = _suffix(path)
    if fmt in JSONL_SUFFIXES:
        return JsonlSource(path, text_field, comp)
    if fmt == ".csv":
        return CsvSource(path, text_field, comp)
    if not comp:
        if fmt in text_ok:
            return TextSource(path)
        if fmt == ".parquet":
            return ParquetSource(path, text_field)
        if fmt == ".arrow":
            return ArrowSource(path, text_field)
    shown = "".join(path.suffixes[-2:]) or "no suffix"
    extra = f", {', '.join(sorted(text_ok - set(TEXT_SUFFIXES)))} as text" if text_ok != set(TEXT_SUFFIXES) else ""
    raise DataError(f"input {str(path)!r} ({shown}) is not a format hybridpar prepare reads: {FORMATS}{extra}; "
                    "convert it, leave it out of --input, or pass --text-suffix SUFFIX to read it as plain text")


# ----------------------------------------------------------------------------- batches of documents

PIECE_CHARS = 4 << 20  # plain-text documents longer than this are encoded in pieces
FIRST, LAST = 1, 2  # flags of a text in a batch: it starts / ends its document (a whole one is both)


class Batch:
    """Texts for one ``encode_batch`` call (documents, or pieces of a long plain-text one) with
    their FIRST / LAST flags, and the stream's position after them: records read (empty ones
    included), the global indices of this batch's empty records, input bytes consumed."""

    __slots__ = ("chars", "done", "empty", "flags", "records", "texts")

    def __init__(self, texts: list[Any], flags: bytearray, chars: int, records: int, empty: list[int],
                 done: int) -> None:
        self.texts, self.flags, self.chars = texts, flags, chars
        self.records, self.empty, self.done = records, empty, done


def pieces(text: Any) -> Iterator[Any]:
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


def read_batches(sources: Sequence[Source], sizes: Sequence[int], needs_text: bool, counts: list[int],
                 batch_chars: Callable[[], int], batch_docs: int) -> Iterator[Batch]:
    """Every source's documents in batches of about ``batch_chars()`` characters (asked again for
    each batch; at most ``batch_docs`` texts); each record is validated as it is read, and a
    plain-text document over PIECE_CHARS is cut into pieces. ``counts[i]`` gets source i's record
    count once it is read through."""
    texts: list[Any] = []
    flags = bytearray()
    empty: list[int] = []
    size = records = base = 0
    limit = batch_chars()
    for i, src in enumerate(sources):
        first_record = records
        long_text = isinstance(src, TextSource)
        for doc in src.documents(needs_text):
            if doc is None:
                empty.append(records)
            elif long_text and len(doc) > PIECE_CHARS:
                parts = list(pieces(doc))
                for k, piece in enumerate(parts):
                    texts.append(piece)
                    flags.append((FIRST if k == 0 else 0) | (LAST if k == len(parts) - 1 else 0))
                    size += len(piece)
                    if size >= limit and k < len(parts) - 1:
                        yield Batch(texts, flags, size, records, empty, base + src.done)
                        texts, flags, empty, size, limit = [], bytearray(), [], 0, batch_chars()
            else:
                texts.append(doc)
                flags.append(FIRST | LAST)
                size += len(doc)
            records += 1
            if size >= limit or len(texts) >= batch_docs:
                yield Batch(texts, flags, size, records, empty, base + src.done)
                texts, flags, empty, size, limit = [], bytearray(), [], 0, batch_chars()
        counts[i] = records - first_record
        base += sizes[i]
    if texts or empty:
        yield Batch(texts, flags, size, records, empty, base)
