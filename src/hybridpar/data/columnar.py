"""The columnar inputs of ``hybridpar prepare``, read with pyarrow one record batch at a time:
Parquet (column ``text_field``), CSV (header row; also ``.gz`` / ``.zst``) and Arrow IPC (one
``.arrow`` file, or the stream files of a ``datasets`` ``save_to_disk`` directory).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hybridpar.data.errors import DataError
from hybridpar.data.sources import FORMATS, Doc, Source, arrow_error, input_stream

_ARROW_FILE_MAGIC = b"ARROW1"  # the IPC file format starts with it; the stream format does not


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
            raise self._error(f"is not a readable Parquet file ({arrow_error(e)}); fix it or leave it out "
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
            raise self._error(f"cannot be read ({arrow_error(e)}); fix it or leave it out of --input") from None


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
            return csv.open_csv(input_stream(self.path, self.comp), read_options=csv.ReadOptions(block_size=1 << 22),
                                parse_options=csv.ParseOptions(newlines_in_values=True), convert_options=convert)
        except Exception as e:  # ArrowInvalid / ArrowKeyError / OSError
            raise self._wrap(e) from None

    def _wrap(self, e: Exception) -> DataError:
        msg = arrow_error(e)
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
            raise DataError(f"cannot read input {str(path)!r}: {arrow_error(e)}; fix it or leave it out of --input") from None
        try:  # by its magic: the stream reader would take the file format's header for a (huge) length
            return _FileBatches(pa.ipc.open_file(source)) if file_format else pa.ipc.open_stream(source)
        except pa.ArrowInvalid as e:
            raise DataError(f"input {str(path)!r} is not an Arrow IPC file ({arrow_error(e)}); hybridpar prepare "
                            f"reads {FORMATS}") from None

    def _batches(self) -> Iterator[Any]:
        for path in self.files():
            reader = self._open(path)
            _check_column(self, reader.schema, self.field)
            try:
                yield from reader
            except Exception as e:  # truncated or corrupt stream
                raise DataError(f"input {str(path)!r} cannot be read ({arrow_error(e)}); fix it or leave it out of "
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
