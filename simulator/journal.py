"""The request log tests read back: one record per start, finish, abort, reject or reset.

Records live in memory (`GET /_sim/log`) and, with `--request-log PATH`, are appended to a JSONL
file flushed per line, so a test can read it even after killing the simulator.
"""

import json
import logging
import threading
import time
from collections import deque

logger = logging.getLogger(__name__)

EVENTS = ("start", "finish", "abort", "reject", "reset")
# Memory bound for long benchmarks (~0.5 KB a record): the oldest records are dropped from
# memory past this; the JSONL file, when given, keeps all of them.
MAX_RECORDS = 500_000


class RequestLog:
    def __init__(self, path: str | None = None) -> None:
        self._lock = threading.Lock()
        self._records: deque[dict] = deque(maxlen=MAX_RECORDS)
        self._file = open(path, "a", encoding="utf-8") if path else None

    def record(
        self,
        event: str,
        rid: str | None,
        dataset: str | None,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        output_sha: str | None = None,
        status: int | None = None,
        **extra: object,
    ) -> dict:
        entry = {
            "event": event,
            "rid": rid,
            "dataset": dataset,
            "time": time.time(),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "output_sha": output_sha,
            "status": status,
            **extra,
        }
        with self._lock:
            self._records.append(entry)
            if self._file is not None:
                self._file.write(json.dumps(entry) + "\n")
                self._file.flush()
        return entry

    def records(self) -> list[dict]:
        with self._lock:
            return list(self._records)

    def clear(self) -> None:
        # Only the in-memory copy: the JSONL file is an append-only trail of the whole run.
        with self._lock:
            self._records.clear()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
