"""What a real SGLang server says it did with each request, from its own request log.

The server runs with ``--log-requests`` (JSON): one ``request.received`` row when a request
arrives and one ``request.finished`` row, with its ``finish_reason`` and token counts, when
it ends (aborted requests too). The servers are shared by every test of a run (and by every
helper with a kept run folder), so a test reads only the rids of its own dataset: each test
names its dataset uniquely, and every rid starts with its dataset's prefix.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sglang_fixture import RealServer

from datagen.client import rid_prefix


@dataclass(frozen=True)
class Served:
    rid: str
    received: float  # epoch seconds, as the server logged it
    finished: float | None  # None: still running
    finish: str | None  # length | stop | abort | None (still running)
    completion_tokens: int
    max_new_tokens: int

    @property
    def normal(self) -> bool:
        """Finished by the model or its cap, not aborted."""
        return self.finish in ("length", "stop")


def unique_dataset(stem: str) -> str:
    """A dataset name no other test or run on the shared server uses."""
    return f"{stem}_{uuid.uuid4().hex[:8]}"


def served(server: RealServer, dataset: str) -> dict[str, Served]:
    """rid -> what the server did with it, for every request of ``dataset`` it received."""
    prefix = rid_prefix(dataset)
    received: dict[str, dict[str, Any]] = {}
    finished: dict[str, dict[str, Any]] = {}
    for row in server.request_log():
        rid = str(row.get("rid", ""))
        if not rid.startswith(prefix):
            continue
        if row.get("event") == "request.received":
            received[rid] = row
        elif row.get("event") == "request.finished":
            finished[rid] = row
    out = {}
    for rid, row in received.items():
        params = (row.get("obj") or {}).get("sampling_params") or {}
        end = finished.get(rid)
        meta = ((end or {}).get("out") or {}).get("meta_info") or {}
        out[rid] = Served(
            rid=rid, received=_epoch(row["timestamp"]),
            finished=_epoch(end["timestamp"]) if end else None,
            finish=(meta.get("finish_reason") or {}).get("type") if end else None,
            completion_tokens=int(meta.get("completion_tokens") or 0),
            max_new_tokens=int(params.get("max_new_tokens") or 0))
    return out


def _epoch(stamp: str) -> float:
    # The server's local time, on this machine: the same clock as time.time() here.
    return datetime.fromisoformat(stamp).timestamp()
