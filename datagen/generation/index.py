"""An index of a dataset's records: what merge and rebuild need, without the token ids.

A record holds its prompt and output ids (~217 KB at 2K prompt + 3.7K output tokens), so
holding every record of a dataset takes ~21 GB at 100,000 records. One pass over the files
indexes them into flat columns (``RecordIndex``: where each line lies on disk, a hash of its
sample id and, for a merge, its time, token counts and id; 28-70 bytes a record, not a
Python object each), the choice of one record per sample (``records.choose``) runs on the
few records that share an id hash, read back from disk, and a second pass copies or counts
the chosen lines. ``Entry`` is one record's index entry as an object, for those few.
"""

from __future__ import annotations

import json
import math
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from datagen.errors import StorageError
from datagen.generation.columns import Ids, batches, frozen, groups
from datagen.generation.records import (
    Problem,
    Rank,
    choose,
    iter_lines,
    list_len,
    record_files,
    record_rank,
    tokens_counted,
)
from datagen.servers import capture

OPEN_FILES = 32  # files a LineReader keeps open: a merge reads every worker's file in turns
CHOOSE_BATCH = 50_000  # records sharing an id hash read back at once to choose among them


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
    trainable_tokens: Any = None  # the record's count inside the training window

    def rank(self) -> Rank:
        return self.id, self.rid, self.time

    def counted_tokens(self, measure: str, window: int = 0) -> int | None:
        """As ``records.counted_tokens`` of the record."""
        return tokens_counted(self.completion_tokens, self.output_len, self.prompt_tokens,
                              self.prompt_len, measure, self.trainable_tokens, window)

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
                 list_len(record.get("output_ids")), bool(record.get("truncated")),
                 record.get("trainable_tokens"))


def iter_index(dataset_dir: Path, check_verbatim: bool = False) -> Iterator[Entry | Problem]:
    """An entry per record (or the problem of its line), in ``iter_records``' order.

    ``check_verbatim`` is for a caller that copies lines: the check costs about as much
    as parsing the line, so counting alone goes without it."""
    for path in record_files(dataset_dir):
        name = str(path)
        for offset, raw, item in iter_lines(path):
            yield item if isinstance(item, Problem) else entry(item, name, offset, raw,
                                                                check_verbatim)


@dataclass
class RecordIndex:
    """One row per record, in ``iter_records``' order (files sorted, lines in order)."""

    merging: bool  # the columns below the line are filled (a merge needs them)
    files: list[str] = field(default_factory=list)
    file: array = field(default_factory=lambda: array("I"))
    offset: array = field(default_factory=lambda: array("Q"))
    size: array = field(default_factory=lambda: array("I"))  # bytes of the line (< 4 GiB)
    key: array = field(default_factory=lambda: array("q"))  # hash(sample id), this process's
    problems: list[Problem] = field(default_factory=list)
    states_gone: int = 0  # records left out: their captured states file is gone (pruned)
    # --
    time: array = field(default_factory=lambda: array("d"))  # NaN: not a number
    verbatim: bytearray = field(default_factory=bytearray)  # 1: copied as is (``entry``)
    prompt_tokens: array = field(default_factory=lambda: array("q"))  # int(... or 0)
    completion_tokens: array = field(default_factory=lambda: array("q"))
    ids: Ids = field(default_factory=Ids)

    def __len__(self) -> int:
        return len(self.offset)

    def where(self, row: int) -> tuple[str, int, int]:
        return self.files[self.file[row]], self.offset[row], self.size[row]


def build_index(dataset_dir: Path, merging: bool = False,
                output_dir: Path | None = None) -> RecordIndex:
    """Index every record under a dataset's records folder (the merge's columns too when
    ``merging``: they cost ~40 more bytes a record and an encode of each line).

    With ``output_dir``, a record naming captured states (``states``, relative to it) whose
    file is gone is left out: prepare prunes the files of attempts the ledger never counted,
    and such a record must not be chosen again (a merge without the ledger, a rebuild)."""
    ix = RecordIndex(merging)
    for number, path in enumerate(record_files(dataset_dir)):
        ix.files.append(str(path))
        for offset, raw, item in iter_lines(path):
            if isinstance(item, Problem):
                ix.problems.append(item)
                continue
            if output_dir is not None and _states_gone(output_dir, item):
                ix.states_gone += 1
                continue
            sid = str(item["id"])
            ix.key.append(hash(sid))
            ix.file.append(number)
            ix.offset.append(offset)
            ix.size.append(len(raw))
            if merging:
                _add_merge_columns(ix, sid, item, raw)
    return ix


def _states_gone(output_dir: Path, record: dict[str, Any]) -> bool:
    states = record.get("states")
    if not isinstance(states, str):
        return False
    path = output_dir / states
    # consumed by the `captured` build (keep_captured_states off): counted, not pruned
    return not path.is_file() and not capture.built_path(path).is_file()


def _add_merge_columns(ix: RecordIndex, sid: str, record: dict[str, Any], raw: bytes) -> None:
    ix.ids.add(sid)
    ix.time.append(_time_key(record.get("time", 0)))
    # surrogatepass: a lone surrogate then differs from its \u escape (not verbatim)
    # instead of failing here; it is re-encoded, as the merge always did.
    ix.verbatim.append(encode(record).encode("utf-8", "surrogatepass") == raw)
    ix.prompt_tokens.append(int(record.get("prompt_tokens") or 0))
    ix.completion_tokens.append(int(record.get("completion_tokens") or 0))


def _time_key(value: Any) -> float:
    """A record's time as a float64 that orders exactly as the value does, else NaN."""
    if isinstance(value, int | float):
        try:
            key = float(value)
        except OverflowError:
            return math.nan
        return key if key == value else math.nan
    return math.nan


def choose_rows(ix: RecordIndex, committed: Any = None
                ) -> tuple[np.ndarray, np.ndarray, int]:
    """``records.canonical`` on an index: (the chosen rows ascending, for each the row where
    its sample id first appears, duplicates dropped). Rows alone with their id hash are
    chosen as they are; those that share one are read back and chosen by ``records.choose``
    (which also tells apart two ids that share a hash), CHOOSE_BATCH records at a time."""
    alone, shared, starts = groups(frozen(ix.key, np.int64))
    chosen, firsts, duplicates = [alone], [alone], 0
    with LineReader() as reader:
        for a, b in batches(starts, len(shared), CHOOSE_BATCH):
            rows, first, dropped = _choose_among(ix, np.sort(shared[a:b]), committed, reader)
            chosen.append(rows)
            firsts.append(first)
            duplicates += dropped
    rows, first = np.concatenate(chosen), np.concatenate(firsts)
    order = np.argsort(rows, kind="stable")
    return rows[order], first[order], duplicates


def _choose_among(ix: RecordIndex, rows: np.ndarray, committed: Any, reader: LineReader
                  ) -> tuple[np.ndarray, np.ndarray, int]:
    items = []
    for row in rows.tolist():
        raw = reader.raw(*ix.where(row), "a record")
        items.append((*record_rank(json.loads(raw)), row))
    chosen, _, duplicates = choose(items, lambda item: item[:3], committed)
    first: dict[str, int] = {}
    for item in items:
        first.setdefault(item[0], item[3])
    return (np.array([item[3] for item in chosen.values()], dtype=np.int64),
            np.array([first[sid] for sid in chosen], dtype=np.int64), duplicates)


class LineReader:
    """Reads lines back by (file, offset, size), keeping a few files open."""

    def __init__(self) -> None:
        self._files: OrderedDict[str, IO[bytes]] = OrderedDict()

    def line(self, e: Entry) -> str:
        return self.line_at(e.path, e.offset, e.size, e.verbatim, repr(e.id))

    def line_at(self, path: str, offset: int, size: int, verbatim: bool, what: str) -> str:
        """The line in the merged file's form: as is when verbatim, else re-encoded."""
        raw = self.raw(path, offset, size, what)
        return raw.decode("utf-8") if verbatim else encode(json.loads(raw))

    def raw(self, path: str, offset: int, size: int, what: str) -> bytes:
        fh = self._file(path)
        fh.seek(offset)
        raw = fh.read(size)
        if len(raw) != size:
            raise StorageError(f"{path}: record {what} at byte {offset} is shorter "
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
