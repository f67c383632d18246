"""Merging the workers' record files into one ``raw_responses.jsonl`` per dataset.

One record per sample id (``records.canonical``): the one the ledger counted
when Redis knows it, else the earliest written. Records written but never
committed (a worker died between fsync and commit, and the dataset closed
before the redo) are left out by default so the merged tokens equal the counter.

Streamed in two passes (``index``): memory grows with the number of records by a
few hundred bytes each, not with their token ids.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from datagen.generation.index import LineReader, choose_entries
from datagen.generation.records import merged_path, records_dir, write_atomic

log = logging.getLogger(__name__)


@dataclass
class MergeReport:
    dataset: str
    records: int = 0
    duplicates: int = 0
    uncommitted: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    path: str = ""
    problems: list[str] = field(default_factory=list)


def merge_dataset(output_dir: str | Path, dataset: str,
                  committed: Mapping[str, str] | None = None,
                  include_uncommitted: bool = False) -> MergeReport:
    report = MergeReport(dataset)
    chosen, problems, report.duplicates = choose_entries(
        records_dir(output_dir, dataset), committed, check_verbatim=True)
    report.problems = [str(p) for p in problems]
    kept = []
    for sid, e in chosen.items():
        if committed is not None and sid not in committed and not include_uncommitted:
            report.uncommitted += 1
            continue
        kept.append(e)
    del chosen
    kept.sort(key=lambda e: (e.time, e.id))
    for e in kept:
        report.prompt_tokens += int(e.prompt_tokens or 0)
        report.completion_tokens += int(e.completion_tokens or 0)
    path = merged_path(output_dir, dataset)
    with LineReader() as reader:
        report.records = write_atomic(path, (reader.line(e) for e in kept))
    report.path = str(path)
    for problem in report.problems:
        log.warning("%s", problem)
    return report


def datasets_on_disk(output_dir: str | Path) -> list[str]:
    root = Path(output_dir) / "records"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
