"""A dataset's files, in every form datasets come in, read one row at a time.

Four forms are read: ``.jsonl`` (one JSON object a line), ``.jsonl.gz`` and ``.jsonl.zst``
(the same, compressed; decompressed as a stream) and ``.parquet`` (what the Hugging Face Hub
serves; one row a record, read a batch of rows at a time with pyarrow's
``ParquetFile.iter_batches``, so memory holds one row group, never the file). Each row comes
numbered, with where it is: a line number from 1 in a JSON-lines file, the row's index from 0 in
a parquet file (as ``datasets`` and pandas count). A JSON line comes as its bytes, a parquet
row as the dict pyarrow makes of it (``to_pylist``); the reader takes both to the same code.
A row that cannot be read at all (an overlong line) or a file that ends early or is not what
its name says (a truncated ``.gz`` or ``.zst``, a broken ``.parquet``) comes as ``Unreadable``,
its reason naming what happened; a file's rows after the break are not read, the next file is.
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import zstandard

from datagen.operations.progress import count_lines

JSONL, JSONL_GZ, JSONL_ZST, PARQUET = ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet"
FORMS = (JSONL_GZ, JSONL_ZST, JSONL, PARQUET)  # longest suffix first: "x.jsonl.gz" is gz
# A line longer than this is reported and skipped without being held in memory; a real prompt
# of this size would be far beyond any model's context anyway.
MAX_LINE_BYTES = 16 * 1024 * 1024
# Rows a parquet batch holds: pyarrow reads a row group's columns, then hands out this many
# rows' dicts at a time, so a huge agent row costs at most this many of its kind.
PARQUET_BATCH_ROWS = 256
# Compressed bytes fed to zstd at a time: what comes out of them is held whole, and text
# shrinks up to some hundred times (4 KB of it can be a few MB), so the bites stay small.
ZSTD_READ_BYTES = 1 << 12
# What breaks a compressed stream: a truncated end (EOFError), a damaged one (zlib.error,
# gzip.BadGzipFile, an OSError), or a zstd frame error.
_STREAM_ERRORS = (EOFError, OSError, zlib.error, zstandard.ZstdError)


@dataclass(frozen=True)
class Unreadable:
    """A row (or the rest of a file) that could not be read; reason says why."""

    reason: str


Row = bytes | dict[str, Any] | Unreadable


def form_of(path: Path) -> str | None:
    """The form a file's name says it is in, or None for a file that is not data."""
    return next((form for form in FORMS if path.name.endswith(form)), None)


def dataset_name(path: Path) -> str:
    """The dataset a single data file stands for: its name less the form's suffix."""
    form = form_of(path)
    return path.name[: -len(form)] if form else path.name


def dataset_files(path: Path) -> list[Path]:
    """A dataset's data files: the file itself, or every data file under a folder (hidden
    folders and files left out), in sorted path order."""
    if path.is_file():
        return [path]
    files = (
        f for f in path.rglob("*")
        if f.is_file() and form_of(f) is not None
        and not any(p.startswith(".") for p in f.relative_to(path).parts)
    )
    return sorted(files, key=lambda f: f.relative_to(path).as_posix())


def count_rows(files: list[Path]) -> int | None:
    """Rows in these files, for a progress total; None where counting would mean
    decompressing a file (a compressed one), which costs as much as reading it."""
    total = 0
    for file in files:
        form = form_of(file)
        if form == JSONL:
            total += count_lines([file])
        elif form == PARQUET:
            total += _parquet_rows(file)
        else:
            return None
    return total


def numbered_rows(file: Path, columns: Collection[str]) -> Iterator[tuple[int, Row]]:
    """(where, row) for each non-blank line or each row of a file. For parquet only the
    ``columns`` present are read (the rest may be large: images, audio); a file that has none
    of them comes as one Unreadable row naming the columns it has."""
    if form_of(file) == PARQUET:
        yield from _parquet_rows_of(file, columns)
        return
    with _open_lines(file) as fh:
        line_no = 0
        try:
            while True:
                raw = fh.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    return
                line_no += 1
                if len(raw) > MAX_LINE_BYTES:
                    _skip_rest_of_line(fh, raw)
                    yield line_no, Unreadable(f"line longer than {MAX_LINE_BYTES} bytes")
                elif raw.strip():
                    bom = line_no == 1 and raw.startswith(b"\xef\xbb\xbf")
                    yield line_no, raw[3:] if bom else raw
        except _STREAM_ERRORS as exc:
            yield line_no + 1, Unreadable(f"the file cannot be read past line {line_no} "
                                          f"({_stream_error(exc)}); the rest of it is skipped")


def _open_lines(file: Path) -> BinaryIO:
    form = form_of(file)
    if form == JSONL_GZ:
        return gzip.open(file, "rb")  # type: ignore[return-value]
    if form == JSONL_ZST:
        return io.BufferedReader(_ZstdStream(file.open("rb")))  # type: ignore[return-value]
    return file.open("rb")


def _stream_error(exc: BaseException) -> str:
    if isinstance(exc, EOFError):
        return f"truncated: {exc}"
    return f"{type(exc).__name__}: {exc}"


def _skip_rest_of_line(fh: BinaryIO, chunk: bytes) -> None:
    while chunk and not chunk.endswith(b"\n"):
        chunk = fh.readline(MAX_LINE_BYTES)


class _ZstdStream(io.RawIOBase):
    """A .zst file decompressed as a stream, frame after frame, that raises EOFError where
    the file ends inside a frame (zstandard's own stream reader ends there silently)."""

    def __init__(self, raw: BinaryIO) -> None:
        super().__init__()
        self._raw = raw
        self._frame = zstandard.ZstdDecompressor().decompressobj()
        self._in_frame = False
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._out:
            data = self._raw.read(ZSTD_READ_BYTES)
            if not data:
                if self._in_frame:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            self._out = memoryview(self._decompress(data))
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            self._in_frame = True
            out.append(self._frame.decompress(data))
            data = b""
            if self._frame.eof:  # a frame ended: what follows starts the next one
                data = self._frame.unused_data
                self._frame = zstandard.ZstdDecompressor().decompressobj()
                self._in_frame = False
        return b"".join(out)

    def close(self) -> None:
        self._raw.close()
        super().close()


def _parquet_rows(file: Path) -> int:
    import pyarrow as pa  # noqa: PLC0415 (pyarrow loads only for parquet data)
    import pyarrow.parquet as pq  # noqa: PLC0415

    try:
        return pq.ParquetFile(file).metadata.num_rows
    except (pa.ArrowException, OSError):  # a broken file: reading it reports why
        return 0


def _parquet_rows_of(file: Path, columns: Collection[str]) -> Iterator[tuple[int, Row]]:
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    index = 0
    try:
        with pq.ParquetFile(file) as parquet:
            names = parquet.schema_arrow.names
            wanted = [name for name in names if name in columns]
            if not wanted:
                yield 0, Unreadable(f"none of the columns {', '.join(columns)} "
                                    f"(columns: {', '.join(names) or 'none'}); file skipped")
                return
            for group in range(parquet.num_row_groups):
                # One row group at a time: over the whole file, pyarrow's pre-buffering reads
                # every group's bytes before the first batch; and a batch never spans two
                # groups, so a damaged group is reported from its first row.
                for batch in parquet.iter_batches(PARQUET_BATCH_ROWS, row_groups=[group],
                                                  columns=wanted):
                    for row in batch.to_pylist():
                        yield index, row
                        index += 1
    except (pa.ArrowException, OSError) as exc:
        yield index, Unreadable(f"not a readable parquet file past row {index} "
                                f"({type(exc).__name__}: {exc}); the rest of it is skipped")
