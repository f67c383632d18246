"""What a real SGLang server says it did with each request, from its own logs.

Launched with ``--log-requests`` (JSON, ``cli.sglang.launch_argv``), SGLang 0.5.23 writes
one ``request.received`` row when a request arrives and one ``request.finished`` row, with
its ``finish_reason`` and token counts, when it ends, aborted requests too, each after a
``[date time] `` stamp. One exception, measured: a non-streaming request whose client went
away (its process died, so its sockets closed) is aborted by the server itself and logged
only in the server's own log ("Request is disconnected from the client side ... rid='…'"),
with no ``request.finished`` row. The tests and ``bench/bench_abort.py`` read both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

DISCONNECTED = "Request is disconnected from the client side"


@dataclass(frozen=True)
class Served:
    rid: str
    received: float  # epoch seconds, as the server logged it
    finished: float | None  # None: still running (or dropped for a disconnected client)
    finish: str | None  # length | stop | abort | None (not finished)
    completion_tokens: int
    max_new_tokens: int

    @property
    def normal(self) -> bool:
        """Finished by the model or its cap, not aborted."""
        return self.finish in ("length", "stop")


def request_rows(request_log_dir: Path) -> list[dict[str, Any]]:
    """Every row of the request log folder; a line still being written is left out."""
    rows = []
    for path in sorted(Path(request_log_dir).glob("*")):
        for line in path.read_text(errors="replace").splitlines():
            start = line.find("{")
            if start < 0 or not line.endswith("}"):
                continue
            try:
                rows.append(json.loads(line[start:]))
            except ValueError:
                continue  # half a line, written while we read
    return rows


def served(rows: list[dict[str, Any]], prefix: str) -> dict[str, Served]:
    """rid -> what the server did with it, for every request whose rid starts with
    ``prefix`` that it received."""
    received: dict[str, dict[str, Any]] = {}
    finished: dict[str, dict[str, Any]] = {}
    for row in rows:
        rid = str(row.get("rid", ""))
        if not rid.startswith(prefix):
            continue
        if row.get("event") == "request.received":
            received[rid] = row
        elif row.get("event") == "request.finished":
            finished[rid] = row
    return {rid: _served(rid, row, finished.get(rid)) for rid, row in received.items()}


def _served(rid: str, row: dict[str, Any], end: dict[str, Any] | None) -> Served:
    params = (row.get("obj") or {}).get("sampling_params") or {}
    meta = ((end or {}).get("out") or {}).get("meta_info") or {}
    return Served(rid=rid, received=_epoch(row["timestamp"]),
                  finished=_epoch(end["timestamp"]) if end else None,
                  finish=(meta.get("finish_reason") or {}).get("type") if end else None,
                  completion_tokens=int(meta.get("completion_tokens") or 0),
                  max_new_tokens=int(params.get("max_new_tokens") or 0))


def disconnected(server_log: Path) -> set[str]:
    """The rids the server aborted itself because their client went away."""
    if not Path(server_log).exists():
        return set()
    return {line.rsplit("rid='", 1)[1].rstrip("'")
            for line in Path(server_log).read_text(errors="replace").splitlines()
            if DISCONNECTED in line and "rid='" in line}


def decoding(rows: dict[str, Served], rids: set[str], gone: set[str]) -> set[str]:
    """Those of ``rids`` the server received and has not ended (``gone``: disconnected)."""
    return {rid for rid in rids if rid in rows and rows[rid].finished is None
            and rid not in gone}


def _epoch(stamp: str) -> float:
    # The server's local time, on this machine: the same clock as time.time() here.
    return datetime.fromisoformat(stamp).timestamp()
