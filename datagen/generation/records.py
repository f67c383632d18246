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

import base64
import errno
import json
import logging
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

from datagen import json_codec
from datagen.errors import StorageError

log = logging.getLogger(__name__)

RECORD_VERSION = 1
RECORDS_DIR = "records"
MERGED_NAME = "raw_responses.jsonl"


def pack_logprobs(logprobs: Iterable[float]) -> str:
    """A record's ``output_logprobs``: little-endian float32, base64 (5.3 characters a
    token against ~20 for a JSON list)."""
    values = list(logprobs)
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


def unpack_logprobs(text: str) -> list[float]:
    """``pack_logprobs`` read back; ValueError when it is not such a string."""
    raw = base64.b64decode(text, validate=True)
    if len(raw) % 4:
        raise ValueError(f"output_logprobs: {len(raw)} bytes is not a float32 array")
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def records_dir(output_dir: str | Path, dataset: str) -> Path:
    return Path(output_dir) / RECORDS_DIR / dataset


def merged_path(output_dir: str | Path, dataset: str) -> Path:
    return Path(output_dir) / dataset / MERGED_NAME


class RecordWriter:
    """Appends records to this process's own file per dataset; thread-safe.

    ``append`` returns once its record is fsynced. One fsync makes durable every line
    written to the file before it, so the threads whose lines an fsync covered return
    without one of their own (a group commit): under load a few fsyncs cover many records
    and no thread writes while waiting for another's fsync."""

    def __init__(self, output_dir: str | Path, writer_id: str | None = None):
        self.output_dir = Path(output_dir)
        self.writer_id = writer_id or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self._lock = threading.Lock()  # writes, and the files' table
        self._files: dict[str, _Appended] = {}

    def append(self, record: Mapping[str, Any]) -> None:
        data = json_codec.dumps(record) + b"\n"  # json's compact bytes, through orjson
        with self._lock:
            try:
                out = self._file(str(record["dataset"]))
                out.fh.write(data)
                out.fh.flush()
            except OSError as exc:
                raise self._failed(record, exc) from exc
            out.written += 1
            line_no = out.written
        try:
            out.sync(line_no)
        except OSError as exc:
            raise self._failed(record, exc) from exc

    def _failed(self, record: Mapping[str, Any], exc: OSError) -> StorageError:
        return StorageError(f"cannot write record {record['id']!r} under "
                            f"{self.output_dir}: {exc.strerror or exc}")

    def _file(self, dataset: str) -> _Appended:
        out = self._files.get(dataset)
        if out is None:
            folder = records_dir(self.output_dir, dataset)
            folder.mkdir(parents=True, exist_ok=True)
            fh = open(folder / f"{self.writer_id}.jsonl", "ab")  # noqa: SIM115 (kept open)
            _end_torn_line(fh)
            out = self._files[dataset] = _Appended(fh)
        return out

    def close(self) -> None:
        with self._lock:
            for out in self._files.values():
                out.close()
            self._files.clear()


class _Appended:
    """One records file: its lines written (flushed to the OS) and fsynced so far."""

    def __init__(self, fh: Any):
        self.fh = fh
        self.written = 0  # raised under the writer's lock, after its line is flushed
        self.synced = 0
        # Lines an fsync covered and failed on: the kernel may have dropped their pages, so a
        # later fsync that succeeds says nothing of them; each of their appends fails
        self.failed_through = 0
        self.sync_lock = threading.Lock()

    def sync(self, line_no: int) -> None:
        """Return once line ``line_no`` is fsynced: by this fsync or a later-started one."""
        with self.sync_lock:
            if self.synced >= line_no:
                return
            if line_no <= self.failed_through:
                raise OSError(errno.EIO, "an fsync that covered this record failed")
            if self.fh.closed:  # closed by ``close``, whose own fsync failed
                raise OSError(errno.EBADF, "the records file was closed before its fsync")
            upto = self.written  # flushed, all of them: this fsync covers them
            try:
                os.fsync(self.fh.fileno())
            except OSError:
                self.failed_through = upto
                raise
            self.synced = upto

    def close(self) -> None:
        """Close the file, fsyncing the lines a thread has written and not yet synced."""
        with self.sync_lock:
            try:
                if self.synced < self.written:
                    os.fsync(self.fh.fileno())
                    self.synced = self.written
            except OSError as exc:
                log.warning("records file %s: fsync at close failed: %s", self.fh.name, exc)
            finally:
                self.fh.close()


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
    for path in record_files(dataset_dir):
        for _, _, item in iter_lines(path):
            yield item


def record_files(dataset_dir: Path) -> list[Path]:
    return sorted(dataset_dir.glob("*.jsonl")) if dataset_dir.is_dir() else []


def iter_lines(path: Path) -> Iterator[tuple[int, bytes, dict[str, Any] | Problem]]:
    """(byte offset, raw line, record or problem) of each non-blank line of one file."""
    offset = 0
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, start=1):
            start, offset = offset, offset + len(raw)
            if raw.strip():
                yield start, raw, _parse(raw, path, number)


def _parse(raw: bytes, path: Path, number: int) -> dict[str, Any] | Problem:
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        torn = not raw.endswith(b"\n")
        return Problem(str(path), number,
                       "torn last line (writer killed mid-write)" if torn else "invalid JSON")
    if not isinstance(record, dict) or "id" not in record:
        return Problem(str(path), number, "not a record (no id)")
    return record


def counted_tokens(record: Mapping[str, Any], measure: str, window: int = 0) -> int | None:
    """The tokens a record counts against the budget, or None when unknown (old format);
    ``window``: train_max_length, for a "trainable" count of a record that does not hold one."""
    return tokens_counted(record.get("completion_tokens"), list_len(record.get("output_ids")),
                          record.get("prompt_tokens"), list_len(record.get("prompt_ids")),
                          measure, record.get("trainable_tokens"), window)


def tokens_counted(completion: Any, output_len: int | None, prompt: Any,
                   prompt_len: int | None, measure: str, trainable: Any = None,
                   window: int = 0) -> int | None:
    """``counted_tokens`` from a record's fields and the lengths of its id lists (None: the
    record has no such list), so that an index of records counts exactly like the records."""
    if completion is None:
        completion = output_len
    if completion is None:
        return None
    if measure == "trainable":
        if trainable is not None:
            return int(trainable)
        # A record from before the count was stored: one turn after its prompt; one that
        # cannot be placed in the window (no prompt length) counts as it always did.
        prompt = prompt_len if prompt_len is not None else prompt
        if prompt is None or not window:
            return int(completion)
        return min(int(completion), max(0, window - int(prompt)))
    if measure == "total":
        if prompt is None:
            prompt = prompt_len
        if prompt is None:
            return None
        return int(prompt) + int(completion)
    return int(completion)


def list_len(value: Any) -> int | None:
    return len(value) if isinstance(value, list) else None


def is_current(record: Mapping[str, Any]) -> bool:
    """A record usable for the next phase: it has the token ids, not only text."""
    return isinstance(record.get("output_ids"), list) and isinstance(
        record.get("prompt_ids"), list)


def loss_spans(record: Mapping[str, Any]) -> list[list[int]] | None:
    """Where the generated ids lie in ``prompt_ids + output_ids``, as [start, end) pairs,
    for a record of several generated turns (``regenerate = "all"``); None for a record of
    one turn, whose generated ids are exactly ``output_ids``."""
    turns = record.get("turns")
    if not isinstance(turns, list) or not turns:
        return None
    return [list(t["span"]) for t in turns]


# What the choice between two copies of a sample looks at: (sample id, rid, time).
Rank = tuple[str, Any, Any]
T = TypeVar("T")


def record_rank(record: Mapping[str, Any]) -> Rank:
    return str(record["id"]), record.get("rid"), record.get("time", 0)


def canonical(records: Iterable[dict[str, Any] | Problem],
              committed: Mapping[str, str] | None = None
              ) -> tuple[dict[str, dict[str, Any]], list[Problem], int]:
    """One record per sample id: the committed one when the ledger knows it, else the
    earliest written. Returns (records by id, problems, duplicates dropped)."""
    return choose(records, record_rank, committed)


def choose(items: Iterable[T | Problem], rank: Callable[[T], Rank],
           committed: Mapping[str, str] | Any = None
           ) -> tuple[dict[str, T], list[Problem], int]:
    """``canonical`` over any items that ``rank`` reads: whole records, or the entries of
    an index of them (``index.Entry``), which are then chosen exactly alike. ``committed``:
    the done map, as a dict or as a ``committed.Committed``."""
    chosen: dict[str, T] = {}
    problems: list[Problem] = []
    duplicates = 0
    for item in items:
        if isinstance(item, Problem):
            problems.append(item)
            continue
        new = rank(item)
        if new[0] in chosen:
            duplicates += 1
            if not _prefer(new, rank(chosen[new[0]]), committed):
                continue
        chosen[new[0]] = item
    return chosen, problems, duplicates


def _prefer(new: Rank, old: Rank, committed: Mapping[str, str] | Any) -> bool:
    sid = new[0]
    if committed and sid in committed:
        if not isinstance(committed, Mapping):  # a ``committed.Committed``: hashes, no str
            return committed.rid_matches(sid, new[1]) and not committed.rid_matches(sid, old[1])
        rid = committed[sid].split(" ", 1)[0]
        return new[1] == rid and old[1] != rid
    # A missing (or null) rid sorts as "".
    return (new[2], _rid_order(new[1])) < (old[2], _rid_order(old[1]))


def _rid_order(rid: Any) -> str:
    return "" if rid is None else str(rid)


@contextmanager
def atomic_file(path: Path) -> Iterator[TextIO]:
    """A text file written under a temporary name, fsynced and renamed to ``path`` when the
    block ends without an error: readers see all of it or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        yield fh
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def write_atomic(path: Path, lines: Iterator[str]) -> int:
    """Write lines to ``path`` atomically (``atomic_file``); returns how many."""
    count = 0
    with atomic_file(path) as fh:
        for line in lines:
            fh.write(line)
            count += 1
    return count
