"""The :class:`Source` interface of ``hybridpar prepare``'s inputs, with the readers that need no
pyarrow for an uncompressed file: plain text (one file, one document) and JSON Lines (read line by
line with the standard ``json`` module, which names the line of a malformed record). The columnar
formats are in :mod:`hybridpar.data.columnar`; :mod:`hybridpar.data.readers` picks a reader by
suffix and lists the formats.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hybridpar.data.errors import DataError

FORMATS = ("text (.txt, .md), JSON Lines (.jsonl, .json, also .gz / .zst), Parquet (.parquet), "
           "CSV (.csv, also .gz / .zst), Arrow (.arrow, or a directory written by datasets' save_to_disk)")
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


def arrow_error(e: Exception) -> str:
    """The first line of a pyarrow error, on one line (it goes into a one-line DataError)."""
    return _one_line(str(e).split("\n")[0] if str(e) else type(e).__name__)


def input_stream(path: Path, comp: str) -> Any:
    """``path`` as a pyarrow input stream, decompressed when ``comp`` names a compression."""
    import pyarrow as pa

    try:
        return pa.input_stream(str(path), compression="detect" if comp else None)
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read input {str(path)!r}: {arrow_error(e)}; fix it or leave it out of --input") from None


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
            stream = io.BufferedReader(input_stream(self.path, self.comp), 1 << 20)
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
                raise self._error(f"cannot be read or decompressed after line {n} ({arrow_error(e)}); fix it or "
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
