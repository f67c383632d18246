"""Merging the workers' record files into one ``raw_responses.jsonl`` per dataset.

One record per sample id (``records.canonical``): the one the ledger counted
when Redis knows it, else the earliest written. Records written but never
committed (a worker died between fsync and commit, and the dataset closed
before the redo) are left out by default so the merged tokens equal the counter.

Streamed in two passes (``index``): memory grows with the number of records by
~100 bytes each (the index's columns, the done map's hashes), not with their token ids.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from datagen.errors import StorageError
from datagen.generation.columns import each, frozen, id_order
from datagen.generation.committed import Committed
from datagen.generation.index import LineReader, RecordIndex, build_index, choose_rows
from datagen.generation.records import merged_path, records_dir, write_atomic

log = logging.getLogger(__name__)


@dataclass
class MergeReport:
    dataset: str
    records: int = 0
    duplicates: int = 0
    uncommitted: int = 0
    states_gone: int = 0  # left out: the captured states they name were pruned
    prompt_tokens: int = 0
    completion_tokens: int = 0
    path: str = ""
    problems: list[str] = field(default_factory=list)


def merge_dataset(output_dir: str | Path, dataset: str,
                  committed: Mapping[str, str] | Committed | None = None,
                  include_uncommitted: bool = False) -> MergeReport:
    """``committed``: the ledger's done map (``Ledger.committed_index``, or a dict); None
    when the ledger is not known: every record counts, the earliest copy per id."""
    report = MergeReport(dataset)
    done = Committed.of(committed)
    ix = build_index(records_dir(output_dir, dataset), merging=True,
                     output_dir=Path(output_dir))
    report.problems = [str(p) for p in ix.problems]
    report.states_gone = ix.states_gone
    rows, _, report.duplicates = choose_rows(ix, done)
    ix.key = array("q")  # not needed any more: 8 bytes a record back before the sort
    if done is not None and not include_uncommitted:
        counted = done.contains_all(ix.ids.get(row) for row in each(rows))
        report.uncommitted = int(len(rows) - counted.sum())
        rows = rows[counted]
    del committed, done  # 24 bytes a sample, not needed for the sort (when the caller let go)
    time = frozen(ix.time, np.float64)
    _check_times(ix, rows, time)
    rows = id_order(time, ix.ids, rows)  # by (time, id)
    report.prompt_tokens = int(frozen(ix.prompt_tokens, np.int64)[rows].sum())
    report.completion_tokens = int(frozen(ix.completion_tokens, np.int64)[rows].sum())
    path = merged_path(output_dir, dataset)
    with LineReader() as reader:
        report.records = write_atomic(path, _lines(ix, rows, reader))
    report.path = str(path)
    for problem in report.problems:
        log.warning("%s", problem)
    return report


def _check_times(ix: RecordIndex, rows: np.ndarray, time: np.ndarray) -> None:
    odd = rows[np.isnan(time[rows])]
    if len(odd):
        path, offset, _ = ix.where(int(odd[0]))
        raise StorageError(f"{path}: record {ix.ids.get(int(odd[0]))!r} at byte {offset} has a "
                           "time that is not a number: the merge orders records by time")


def _lines(ix: RecordIndex, rows: np.ndarray, reader: LineReader) -> Iterator[str]:
    for row in each(rows):
        path, offset, size = ix.where(row)
        yield reader.line_at(path, offset, size, bool(ix.verbatim[row]), repr(ix.ids.get(row)))


def datasets_on_disk(output_dir: str | Path) -> list[str]:
    root = Path(output_dir) / "records"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
