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

``read_batches`` groups the documents of all sources into the batches ``prepare`` encodes. Its
progress: ``Source.done`` counts the input bytes consumed where a reader knows it cheaply
(uncompressed JSON Lines, line by line); the other formats count whole files.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from hybridpar.data.errors import DataError, DataNotFoundError

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIXES = (".jsonl", ".json")
COMPRESSED = (".gz", ".zst")
FORMATS = ("text (.txt, .md), JSON Lines (.jsonl, .json, also .gz / .zst), Parquet (.parquet), "
           "CSV (.csv, also .gz / .zst), Arrow (.arrow, or a directory written by datasets' save_to_disk)")
ARROW_DIR_MARKERS = ("state.json", "dataset_info.json")
DATASET_DICT_FILE = "dataset_dict.json"
_ARROW_FILE_MAGIC = b"ARROW1"  # the IPC file format starts with it; the stream format does not
_SNIFF = 1 << 16
_MAGIC = {b"\x1f\x8b": "gzip-compressed", b"\x28\xb5\x2f\xfd": "zstd-compressed", b"PK\x03\x04": "a zip archive",
          b"BZh": "bzip2-compressed", b"\xfd7zXZ\x00": "xz-compressed", b"PAR1": "a Parquet file",
          b"ARROW1": "an Arrow file", b"\xff\xff\xff\xff": "an Arrow stream", b"\x7fELF": "an executable"}

Doc = str | bytes | None


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _magic(head: bytes) -> str | None:
    for magic, what in _MAGIC.items():
        if head.startswith(magic):
            return what
    return None


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


class Source:
    """One input. ``check(needs_text)`` raises for what is wrong with it as a whole (not its
    format, no such column) without reading it through; ``documents(needs_text)`` yields each
    record's text in order, raising for a bad record: ``str`` (or, for a plain-text file when the
    tokenizer takes bytes, ``bytes``), ``None`` for an empty record."""

    kind = "?"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done = 0  # input bytes consumed by documents(), where the reader knows it (else 0)

    @property
    def name(self) -> str:
        return str(self.path)

    def size(self) -> int:
        if self.path.is_dir():
            return sum(p.stat().st_size for p in self.path.glob("*.arrow"))
        try:
            return self.path.stat().st_size
        except OSError as e:
            raise DataError(f"cannot read input {self.name!r}: {e.strerror or e}; fix it or leave it out of --input") from None

    def check(self, needs_text: bool) -> None:
        raise NotImplementedError

    def documents(self, needs_text: bool) -> Iterator[Doc]:
        raise NotImplementedError

    def _error(self, what: str) -> DataError:
        return DataError(f"input {self.name!r} {what}")


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read input {str(path)!r}: {e.strerror or e}; fix its permissions or leave it "
                        "out of --input") from None


def utf8_text(data: bytes, name: str, tokenizer: str = "bpe") -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"input {name!r} is not UTF-8 text (invalid byte at offset {e.start}); the {tokenizer} tokenizer "
                        "needs UTF-8: convert the file, leave it out of --input, or use --tokenizer bytes") from None


class TextSource(Source):
    """A plain-text file: one document (its bytes)."""

    kind = "text"
    tokenizer_name = "bpe"

    def _binary(self, data: bytes) -> None:
        what = _magic(data[:8])
        if what is None and b"\x00" in data:
            what = f"binary (a NUL byte at offset {data.index(0)})"
        if what is not None:
            raise self._error(f"is {what}, not text; hybridpar prepare reads {FORMATS}; give it the suffix of its "
                              "format (e.g. .jsonl.gz) or leave it out of --input")

    def check(self, needs_text: bool) -> None:
        try:
            with open(self.path, "rb") as f:
                self._binary(f.read(_SNIFF))
        except OSError:
            _read_bytes(self.path)  # raises the one-line error

    def documents(self, needs_text: bool) -> Iterator[Doc]:
        data = _read_bytes(self.path)
        if data:
            self._binary(data)
            yield utf8_text(data, self.name, self.tokenizer_name) if needs_text else data


def _arrow_error(e: Exception) -> str:
    return _one_line(str(e).split("\n")[0] if str(e) else type(e).__name__)


def _input_stream(path: Path, comp: str) -> Any:
    import pyarrow as pa

    try:
        return pa.input_stream(str(path), compression="detect" if comp else None)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read input {str(path)!r}: {_arrow_error(e)}; fix it or leave it out of --input") from None


class JsonlSource(Source):
    """JSON Lines: one object per line, the document in ``text_field``; blank lines are skipped."""

    kind = "jsonl"

    def __init__(self, path: Path, text_field: str, comp: str) -> None:
        super().__init__(path)
        self.field, self.comp = text_field, comp

    def _lines(self) -> Iterator[tuple[int, bytes]]:
        """(line number, line) pairs; an uncompressed file is read with ``open`` (no pyarrow
        needed), a compressed one through pyarrow's decompressing stream."""
        self.done = 0
        if self.comp:
            stream = io.BufferedReader(_input_stream(self.path, self.comp), 1 << 20)
        else:
            try:
                stream = open(self.path, "rb", buffering=1 << 20)  # noqa: SIM115 (closed by the with below)
            except OSError as e:
                raise DataError(f"cannot read input {self.name!r}: {e.strerror or e}; fix it or leave it out of "
                                "--input") from None
        with stream as f:
            n = 0
            try:
                if not self.comp:
                    what = _magic(f.peek(8)[:8])
                    if what is not None:
                        raise self._error(f"is {what}, not JSON Lines text; name it by its format (e.g. "
                                          f"{self.path.name}.gz) or leave it out of --input")
                for n, line in enumerate(f, 1):  # noqa: B007 (n names the failing line below)
                    yield n, line
                    if not self.comp:
                        self.done += len(line)
            except OSError as e:
                raise self._error(f"cannot be read or decompressed after line {n} ({_arrow_error(e)}); fix it or "
                                  "leave it out of --input") from None

    def _record(self, n: int, line: bytes) -> Doc | bool:
        """The text of line ``n``; False for a blank line."""
        try:
            s = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{self.name}:{n}: line {n} is not UTF-8 text (invalid byte at offset {e.start} of the "
                            "line); convert the file to UTF-8 or leave it out of --input") from None
        if not s or s.isspace():  # what strip() would empty, without copying the line
            return False
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as e:
            hint = ("; a .json file must be JSON Lines (one object per line), e.g. jq -c '.[]' in.json > out.jsonl"
                    if n == 1 and s.lstrip().startswith("[") else "; each line must be one JSON object")
            raise DataError(f"{self.name}:{n}: malformed JSON on line {n} ({e.msg} at column {e.colno}){hint}") from None
        if not isinstance(obj, dict):
            raise DataError(f"{self.name}:{n}: line {n} is a JSON {type(obj).__name__}, not an object; each line "
                            f"must be one JSON object with a {self.field!r} field")
        if self.field not in obj:
            fields = ", ".join(map(repr, list(obj)[:20])) or "none"
            raise DataError(f"{self.name}:{n}: line {n} has no field {self.field!r} (fields: {fields}); pass "
                            "--text-field NAME")
        text = obj[self.field]
        if text is None:
            return None
        if not isinstance(text, str):
            raise DataError(f"{self.name}:{n}: field {self.field!r} on line {n} is a JSON {type(text).__name__}, "
                            "not a string; pass the --text-field that holds the text")
        if "\\u" in s or "\\U" in s:  # escapes can spell lone surrogates, which are not text
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise DataError(f"{self.name}:{n}: field {self.field!r} on line {n} is not valid Unicode (an "
                                "unpaired surrogate escape); fix the line or leave the file out of --input") from None
        return text or None

    def check(self, needs_text: bool) -> None:
        """The first line (the file opens, decompresses, is not binary; its record is valid)."""
        for n, line in self._lines():
            self._record(n, line)
            break

    def documents(self, needs_text: bool) -> Iterator[Doc]:
        record = self._record
        for n, line in self._lines():
            rec = record(n, line)
            if rec is not False:
                yield rec  # type: ignore[misc]


def _check_column(source: Source, schema: Any, field: str) -> None:
    import pyarrow as pa

    if field not in schema.names:
        cols = ", ".join(map(repr, schema.names[:20])) or "none"
        raise source._error(f"has no column {field!r} (columns: {cols}); pass --text-field NAME")
    typ = schema.field(field).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or str(typ) == "string_view"):
        raise source._error(f"column {field!r} holds {typ}, not text (strings); pass the --text-field that holds "
                            "the text")


def _batch_texts(batch: Any, field: str) -> Iterator[Doc]:
    for text in batch.column(field).to_pylist():
        yield text or None


class ParquetSource(Source):
    kind = "parquet"

    def __init__(self, path: Path, text_field: str) -> None:
        super().__init__(path)
        self.field = text_field

    def _open(self) -> Any:
        import pyarrow.parquet as pq

        try:  # read through a 1 MiB buffer, not pre-buffered: pyarrow's memory would grow with the file
            return pq.ParquetFile(str(self.path), pre_buffer=False, buffer_size=1 << 20)
        except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
            raise self._error(f"is not a readable Parquet file ({_arrow_error(e)}); fix it or leave it out "
                              "of --input") from None

    def check(self, needs_text: bool) -> None:
        _check_column(self, self._open().schema_arrow, self.field)

    def documents(self, needs_text: bool) -> Iterator[Doc]:
        pf = self._open()
        _check_column(self, pf.schema_arrow, self.field)
        try:
            for batch in pf.iter_batches(batch_size=1024, columns=[self.field]):
                yield from _batch_texts(batch, self.field)
        except (OSError, ValueError) as e:
            raise self._error(f"cannot be read ({_arrow_error(e)}); fix it or leave it out of --input") from None


class CsvSource(Source):
    """CSV with a header row; quoted values may span lines."""

    kind = "csv"

    def __init__(self, path: Path, text_field: str, comp: str) -> None:
        super().__init__(path)
        self.field, self.comp = text_field, comp

    def _reader(self, column: bool) -> Any:
        import pyarrow as pa
        from pyarrow import csv

        convert = csv.ConvertOptions(include_columns=[self.field], column_types={self.field: pa.string()},
                                     strings_can_be_null=False) if column else None
        try:
            return csv.open_csv(_input_stream(self.path, self.comp), read_options=csv.ReadOptions(block_size=1 << 22),
                                parse_options=csv.ParseOptions(newlines_in_values=True), convert_options=convert)
        except Exception as e:  # ArrowInvalid / ArrowKeyError / OSError
            raise self._wrap(e) from None

    def _wrap(self, e: Exception) -> DataError:
        msg = _arrow_error(e)
        if "UTF8" in msg or "UTF-8" in msg:
            return self._error(f"is not UTF-8 text ({msg}); convert the file to UTF-8 or leave it out of --input")
        return self._error(f"is not a readable CSV file ({msg}); fix it or leave it out of --input")

    def _batches(self) -> Iterator[Any]:
        try:
            reader = self._reader(True)
        except DataError:
            _check_column(self, self._reader(False).schema, self.field)  # names the columns present
            raise
        try:
            yield from reader
        except Exception as e:  # parse and conversion errors surface while reading
            raise self._wrap(e) from None

    def check(self, needs_text: bool) -> None:
        try:
            self._reader(True).close()
        except DataError:
            _check_column(self, self._reader(False).schema, self.field)  # names the columns present
            raise

    def documents(self, needs_text: bool) -> Iterator[Doc]:
        for batch in self._batches():
            yield from _batch_texts(batch, self.field)


class ArrowSource(Source):
    """Arrow IPC: the stream files of a ``save_to_disk`` directory (in ``state.json``'s order), or
    one ``.arrow`` file (stream or file format), read one record batch at a time."""

    kind = "arrow"

    def __init__(self, path: Path, text_field: str) -> None:
        super().__init__(path)
        self.field = text_field

    def files(self) -> list[Path]:
        if not self.path.is_dir():
            return [self.path]
        state = self.path / "state.json"
        if state.is_file():
            try:
                names = [f["filename"] for f in json.loads(state.read_text())["_data_files"]]
                return [self.path / n for n in names]
            except (OSError, ValueError, KeyError, TypeError):
                pass
        return sorted(self.path.glob("*.arrow"))

    def _open(self, path: Path) -> Any:
        import pyarrow as pa

        try:  # read, not memory-mapped: the pages of a mapped file would count as ours, growing with it
            source = pa.OSFile(str(path))
            file_format = source.read(len(_ARROW_FILE_MAGIC)) == _ARROW_FILE_MAGIC
            source.seek(0)
        except OSError as e:
            raise DataError(f"cannot read input {str(path)!r}: {_arrow_error(e)}; fix it or leave it out of --input") from None
        try:  # by its magic: the stream reader would take the file format's header for a (huge) length
            return _FileBatches(pa.ipc.open_file(source)) if file_format else pa.ipc.open_stream(source)
        except pa.ArrowInvalid as e:
            raise DataError(f"input {str(path)!r} is not an Arrow IPC file ({_arrow_error(e)}); hybridpar prepare "
                            f"reads {FORMATS}") from None

    def _batches(self) -> Iterator[Any]:
        for path in self.files():
            reader = self._open(path)
            _check_column(self, reader.schema, self.field)
            try:
                yield from reader
            except Exception as e:  # truncated or corrupt stream
                raise DataError(f"input {str(path)!r} cannot be read ({_arrow_error(e)}); fix it or leave it out of "
                                "--input") from None

    def check(self, needs_text: bool) -> None:
        for path in self.files():
            _check_column(self, self._open(path).schema, self.field)

    def documents(self, needs_text: bool) -> Iterator[Doc]:
        for batch in self._batches():
            yield from _batch_texts(batch.select([self.field]), self.field)


class _FileBatches:
    def __init__(self, f: Any) -> None:
        self.f, self.schema = f, f.schema

    def __iter__(self) -> Iterator[Any]:
        for i in range(self.f.num_record_batches):
            yield self.f.get_batch(i)


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
