"""Parts of bench/bench_fleet_scale.py: what it reads from the run while the run goes on.

Redis times every command it runs when ``slowlog-log-slower-than`` is 0; the sampler drains
that log (SLOWLOG GET and RESET in one MULTI, so no entry falls between them) once a second
and keeps the execution time of each ledger script, told apart by the sha1 EVALSHA names.
These are Redis-side times: a script's run inside Redis, not the client's round trip.
"""

from __future__ import annotations

import hashlib
import os
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from datagen import keys
from datagen.generation.ledger import Ledger, _script

SLOWLOG_MAX_LEN = 1_000_000
TASK_DISCARDED = "Discarding revoked task: datagen.generate["
TASK_LINE = re.compile(r"Task datagen\.generate\[[^\]]+\] (\w+)(?: in [0-9.e-]+s: '(\w+)')?")


def script_shas() -> dict[str, str]:
    """sha1 -> script name, as redis-py's register_script computes it for the ledger."""
    return {hashlib.sha1(_script(f"{name}.lua").encode()).hexdigest(): name
            for name in Ledger.SCRIPTS}


def percentiles(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"calls": 0}
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"calls": len(ordered), "p50_us": at(0.50), "p99_us": at(0.99),
            "max_us": ordered[-1], "mean_us": round(statistics.fmean(ordered), 1)}


class Sampler(threading.Thread):
    """Once a second: drains Redis's slowlog into script times, and notes the time, the
    samples counted per dataset, Redis's used_memory (with the slowlog emptied, and what the
    slowlog held) and the load average."""

    def __init__(self, sock: Path, datasets: Sequence[str], interval_s: float = 1.0):
        super().__init__(name="sampler", daemon=True)
        # bytes: redis-py cannot parse SLOWLOG GET in a MULTI with decode_responses
        self.r = redis.Redis(unix_socket_path=str(sock))
        self.datasets = list(datasets)
        self.interval_s = interval_s
        self.shas = script_shas()
        self.times: dict[str, list[int]] = {name: [] for name in Ledger.SCRIPTS}
        self.series: list[dict[str, Any]] = []
        self.entries = 0
        self.lost = 0
        self._last_id: int | None = None
        self._halt = threading.Event()
        self.error: BaseException | None = None

    def start_logging(self) -> None:
        self.r.config_set("slowlog-max-len", SLOWLOG_MAX_LEN)
        self.r.config_set("slowlog-log-slower-than", 0)
        self.r.slowlog_reset()

    def run(self) -> None:
        try:
            while not self._halt.wait(self.interval_s):
                self.sample()
            self.sample()
        except BaseException as exc:  # reported by stop(), in the bench's thread
            self.error = exc

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=60)
        if self.error is not None:
            raise RuntimeError(f"sampler failed: {self.error!r}") from self.error

    def sample(self) -> None:
        with self.r.pipeline(transaction=True) as pipe:
            pipe.info("memory")
            pipe.slowlog_get(-1)
            pipe.slowlog_reset()
            pipe.info("memory")
            for name in self.datasets:
                pipe.hget(keys.dataset_key(name, keys.STATS), "samples")
            logged, entries, _, memory, *done = pipe.execute()
        self._drain(entries)
        # used_memory with the slowlog emptied: the run's own data (ledger, queues)
        self.series.append({"t": time.monotonic(), "done": [int(x or 0) for x in done],
                            "used_memory": int(memory["used_memory"]),
                            "slowlog_memory": int(logged["used_memory"])
                            - int(memory["used_memory"]),
                            "load1": os.getloadavg()[0]})

    def _drain(self, entries: list[dict[str, Any]]) -> None:
        ids = [int(e["id"]) for e in entries]
        if ids and self._last_id is not None:
            # Between two drains one id is missing by design: the last drain's own SLOWLOG
            # GET, logged once it ran and cleared by the RESET after it. More: overflow.
            self.lost += max(ids) - self._last_id - len(ids) - 1
        if ids:
            self._last_id = max(ids)
        self.entries += len(entries)
        for entry in entries:
            command = entry["command"]
            if isinstance(command, bytes):
                command = command.decode(errors="replace")
            words = command.split(" ", 2)
            if words[0].upper() == "EVALSHA" and len(words) > 1 and words[1] in self.shas:
                self.times[self.shas[words[1]]].append(int(entry["duration"]))

    def scripts(self) -> dict[str, Any]:
        return {name: percentiles(values) for name, values in self.times.items() if values}

    def load(self) -> dict[str, float]:
        loads = [s["load1"] for s in self.series]
        return {"min": min(loads), "median": statistics.median(loads), "max": max(loads)}

    def generation(self) -> dict[str, Any]:
        """Samples counted over the time from the first counted to the last counted."""
        totals = [(s["t"], sum(s["done"])) for s in self.series]
        final = totals[-1][1]
        first = next(t for t, n in totals if n > 0)
        last = next(t for t, n in totals if n == final)
        seconds = max(last - first, 1e-9)
        return {"samples": final, "first_to_last_count_s": round(seconds, 1),
                "samples_per_s": round(final / seconds, 2),
                "redis_used_memory_max_mb": round(
                    max(s["used_memory"] for s in self.series) / 1e6, 1),
                "slowlog_memory_max_mb": round(
                    max(s["slowlog_memory"] for s in self.series) / 1e6, 1)}


def vm_hwm_mb(pid: int) -> float:
    """A live process's peak resident memory (VmHWM), MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmHWM for pid {pid}")


def task_runs(logs: Sequence[Path]) -> dict[str, Any]:
    """Celery's own count, from the workers' logs: tasks received, revoked ones discarded,
    and how the others ended: succeeded with the runner's outcome (stored, duplicate...),
    or ignored (parked to wait for room, refused by a closed dataset, dead-lettered)."""
    received = discarded = 0
    ends: Counter[str] = Counter()
    for log in logs:
        with open(log, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if TASK_DISCARDED in line:
                    discarded += 1
                elif found := TASK_LINE.search(line):
                    verb, outcome = found.groups()
                    if verb == "received":
                        received += 1
                    else:
                        ends[f"{verb}: {outcome}" if outcome else verb] += 1
    return {"received": received, "discarded_revoked": discarded,
            "ends": dict(ends.most_common())}
