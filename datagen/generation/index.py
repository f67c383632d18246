"""An index of a dataset's records: what merge and rebuild need, without the token ids.

A record holds its prompt and output ids (~217 KB at 2K prompt + 3.7K output tokens), so
holding every record of a dataset takes ~21 GB at 100,000 records. An entry is the
record's scalar fields, the lengths of its id lists and where its line lies on disk
(~0.5 KB): one pass over the files indexes them, the choice of one record per sample
(``records.choose``) runs on the entries, and a second pass copies the chosen lines.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from datagen.errors import StorageError
from datagen.generation.records import (
    Problem,
    Rank,
    choose,
    iter_lines,
    list_len,
    record_files,
    tokens_counted,
)

OPEN_FILES = 32  # files a LineReader keeps open: a merge reads every worker's file in turns


@dataclass(frozen=True, slots=True)
class Entry:
    id: str
    rid: Any  # None when the record has none
    time: Any
    path: str  # one str object shared by all entries of a file
    offset: int
    size: int
    # Known to be exactly ``encode(record)``: copied as is (False: re-encoded, same bytes).
    verbatim: bool
    prompt_tokens: Any
    completion_tokens: Any
    prompt_len: int | None  # len(prompt_ids), None when it is not a list
    output_len: int | None
    truncated: bool

    def rank(self) -> Rank:
        return self.id, self.rid, self.time

    def counted_tokens(self, measure: str) -> int | None:
        """As ``records.counted_tokens`` of the record."""
        return tokens_counted(self.completion_tokens, self.output_len, self.prompt_tokens,
                              self.prompt_len, measure)

    def is_current(self) -> bool:
        """As ``records.is_current`` of the record."""
        return self.output_len is not None and self.prompt_len is not None


def encode(record: Mapping[str, Any]) -> str:
    """A record's line in the merged file (the compact form the workers write)."""
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n"


def entry(record: Mapping[str, Any], path: str, offset: int, raw: bytes,
          check_verbatim: bool) -> Entry:
    # surrogatepass: a lone surrogate then differs from its \u escape (not verbatim)
    # instead of failing here; it is re-encoded, as the merge always did.
    verbatim = check_verbatim and encode(record).encode("utf-8", "surrogatepass") == raw
    return Entry(str(record["id"]), record.get("rid"), record.get("time", 0), path, offset,
                 len(raw), verbatim, record.get("prompt_tokens"),
                 record.get("completion_tokens"), list_len(record.get("prompt_ids")),
                 list_len(record.get("output_ids")), bool(record.get("truncated")))


def iter_index(dataset_dir: Path, check_verbatim: bool = False) -> Iterator[Entry | Problem]:
    """An entry per record (or the problem of its line), in ``iter_records``' order.

    ``check_verbatim`` is for a caller that copies lines: the check costs about as much
    as parsing the line, so counting alone goes without it."""
    for path in record_files(dataset_dir):
        name = str(path)
        for offset, raw, item in iter_lines(path):
            yield item if isinstance(item, Problem) else entry(item, name, offset, raw,
                                                                check_verbatim)


def choose_entries(dataset_dir: Path, committed: Mapping[str, str] | None = None,
                   check_verbatim: bool = False
                   ) -> tuple[dict[str, Entry], list[Problem], int]:
    """``records.canonical`` of the dataset's records, as entries."""
    return choose(iter_index(dataset_dir, check_verbatim), Entry.rank, committed)


class LineReader:
    """Reads the lines of chosen entries back, keeping a few files open."""

    def __init__(self) -> None:
        self._files: OrderedDict[str, IO[bytes]] = OrderedDict()

    def line(self, e: Entry) -> str:
        raw = self._read(e)
        return raw.decode("utf-8") if e.verbatim else encode(json.loads(raw))

    def _read(self, e: Entry) -> bytes:
        fh = self._file(e.path)
        fh.seek(e.offset)
        raw = fh.read(e.size)
        if len(raw) != e.size:
            raise StorageError(f"{e.path}: record {e.id!r} at byte {e.offset} is shorter "
                               "than when it was indexed (file truncated meanwhile?)")
        return raw

    def _file(self, path: str) -> IO[bytes]:
        fh = self._files.get(path)
        if fh is None:
            if len(self._files) >= OPEN_FILES:
                self._files.popitem(last=False)[1].close()
            fh = self._files[path] = open(path, "rb")  # noqa: SIM115 (closed in close())
        else:
            self._files.move_to_end(path)
        return fh

    def close(self) -> None:
        for fh in self._files.values():
            fh.close()
        self._files.clear()

    def __enter__(self) -> LineReader:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
