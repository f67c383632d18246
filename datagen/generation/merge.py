"""Merging the workers' record files into one ``raw_responses.jsonl`` per dataset.

One record per sample id (``records.canonical``): the one the ledger counted
when Redis knows it, else the earliest written. Records written but never
committed (a worker died between fsync and commit, and the dataset closed
before the redo) are left out by default so the merged tokens equal the counter.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from datagen.generation.records import (
    Problem,
    canonical,
    iter_records,
    merged_path,
    records_dir,
    write_atomic,
)

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
    chosen, problems, duplicates = canonical(
        iter_records(records_dir(output_dir, dataset)), committed)
    report.duplicates = duplicates
    report.problems = [str(p) for p in problems if isinstance(p, Problem)]
    kept = []
    for sid, record in chosen.items():
        if committed is not None and sid not in committed and not include_uncommitted:
            report.uncommitted += 1
            continue
        kept.append(record)
    kept.sort(key=lambda r: (r.get("time", 0), str(r["id"])))
    for record in kept:
        report.prompt_tokens += int(record.get("prompt_tokens") or 0)
        report.completion_tokens += int(record.get("completion_tokens") or 0)
    path = merged_path(output_dir, dataset)
    report.records = write_atomic(
        path, (json.dumps(r, separators=(",", ":"), ensure_ascii=False) + "\n" for r in kept))
    report.path = str(path)
    for problem in report.problems:
        log.warning("%s", problem)
    return report


def datasets_on_disk(output_dir: str | Path) -> list[str]:
    root = Path(output_dir) / "records"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
