"""Durable response records on a (possibly shared) filesystem.

Each worker process appends to files of its own, ``records/<dataset>/<owner>.jsonl``
(owner = host, pid and a random part: unique per process start, so a restarted container
with the same host name and pid starts a file of its own), so no two processes ever append
to one file over NFS. A record is flushed and
fsynced before its tokens are committed in the ledger: a crash can leave a record
that is not counted (it is redone and the later copy ignored at merge), never a
count without a record. A torn last line (killed mid-write) is skipped when read.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datagen.errors import StorageError

log = logging.getLogger(__name__)

RECORD_VERSION = 1
RECORDS_DIR = "records"
MERGED_NAME = "raw_responses.jsonl"


def records_dir(output_dir: str | Path, dataset: str) -> Path:
    return Path(output_dir) / RECORDS_DIR / dataset


def merged_path(output_dir: str | Path, dataset: str) -> Path:
    return Path(output_dir) / dataset / MERGED_NAME


class RecordWriter:
    """Appends records to this process's own file per dataset; thread-safe."""

    def __init__(self, output_dir: str | Path, writer_id: str | None = None):
        self.output_dir = Path(output_dir)
        self.writer_id = writer_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._lock = threading.Lock()
        self._files: dict[str, Any] = {}

    def append(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n"
        data = line.encode("utf-8")
        with self._lock:
            try:
                fh = self._file(str(record["dataset"]))
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            except OSError as exc:
                raise StorageError(f"cannot write record {record['id']!r} under "
                                   f"{self.output_dir}: {exc.strerror or exc}") from exc

    def _file(self, dataset: str) -> Any:
        fh = self._files.get(dataset)
        if fh is None:
            folder = records_dir(self.output_dir, dataset)
            folder.mkdir(parents=True, exist_ok=True)
            fh = open(folder / f"{self.writer_id}.jsonl", "ab")  # noqa: SIM115 (kept open)
            _end_torn_line(fh)
            self._files[dataset] = fh
        return fh

    def close(self) -> None:
        with self._lock:
            for fh in self._files.values():
                fh.close()
            self._files.clear()


def _end_torn_line(fh: Any) -> None:
    """A file that ends mid-line (its writer was killed mid-write) gets a newline first, so
    the next record starts a line of its own instead of being glued to the torn one."""
    size = os.fstat(fh.fileno()).st_size
    if not size:
        return
    with open(fh.name, "rb") as reader:
        reader.seek(size - 1)
        if reader.read(1) != b"\n":
            fh.write(b"\n")
            fh.flush()


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


def iter_records(dataset_dir: Path) -> Iterator[dict[str, Any] | Problem]:
    """Every record under one dataset's records folder, in a stable order."""
    if not dataset_dir.is_dir():
        return
    for path in sorted(dataset_dir.glob("*.jsonl")):
        yield from _iter_file(path)


def _iter_file(path: Path) -> Iterator[dict[str, Any] | Problem]:
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                torn = not raw.endswith(b"\n")
                yield Problem(str(path), number,
                              "torn last line (writer killed mid-write)" if torn
                              else "invalid JSON")
                continue
            if not isinstance(record, dict) or "id" not in record:
                yield Problem(str(path), number, "not a record (no id)")
                continue
            yield record


def counted_tokens(record: Mapping[str, Any], measure: str) -> int | None:
    """The tokens a record counts against the budget, or None when unknown (old format)."""
    completion = record.get("completion_tokens")
    if completion is None and isinstance(record.get("output_ids"), list):
        completion = len(record["output_ids"])
    if completion is None:
        return None
    if measure == "total":
        prompt = record.get("prompt_tokens")
        if prompt is None and isinstance(record.get("prompt_ids"), list):
            prompt = len(record["prompt_ids"])
        if prompt is None:
            return None
        return int(prompt) + int(completion)
    return int(completion)


def is_current(record: Mapping[str, Any]) -> bool:
    """A record usable for the next phase: it has the token ids, not only text."""
    return isinstance(record.get("output_ids"), list) and isinstance(
        record.get("prompt_ids"), list)


def canonical(records: Iterator[dict[str, Any] | Problem],
              committed: Mapping[str, str] | None = None
              ) -> tuple[dict[str, dict[str, Any]], list[Problem], int]:
    """One record per sample id: the committed one when the ledger knows it, else the
    earliest written. Returns (records by id, problems, duplicates dropped)."""
    chosen: dict[str, dict[str, Any]] = {}
    problems: list[Problem] = []
    duplicates = 0
    for item in records:
        if isinstance(item, Problem):
            problems.append(item)
            continue
        sid = str(item["id"])
        if sid in chosen:
            duplicates += 1
            if _prefer(item, chosen[sid], committed):
                chosen[sid] = item
            continue
        chosen[sid] = item
    return chosen, problems, duplicates


def _prefer(new: Mapping[str, Any], old: Mapping[str, Any],
            committed: Mapping[str, str] | None) -> bool:
    if committed and str(new["id"]) in committed:
        rid = committed[str(new["id"])].split(" ", 1)[0]
        return new.get("rid") == rid and old.get("rid") != rid
    return (new.get("time", 0), str(new.get("rid", ""))) < (
        old.get("time", 0), str(old.get("rid", "")))


def write_atomic(path: Path, lines: Iterator[str]) -> int:
    """Write lines to a temporary file, fsync and rename: readers see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    count = 0
    with open(tmp, "w", encoding="utf-8") as fh:
        for line in lines:
            fh.write(line)
            count += 1
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return count
