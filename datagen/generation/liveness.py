"""Worker heartbeats and the reaper that gives a dead worker's samples back.

Tasks are acked early (REFERENCE §4), so when a worker dies its in-flight
samples exist only as ledger entries. Every worker refreshes a short-lived
``alive`` key; any live worker's reaper re-enqueues the in-flight samples of a
worker whose key expired. A sample is then redone within a few leases instead
of after kombu's visibility timeout, and counted once by ``commit.lua``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from datagen import keys
from datagen.generation.job import Job
from datagen.generation.ledger import Ledger

log = logging.getLogger(__name__)

REAPER_LOCK = keys.PREFIX + "reaper_lock"


class Heartbeat:
    def __init__(self, ledger: Ledger, worker_id: str, lease_s: float,
                 requeue: Callable[[Job], None]):
        self.ledger = ledger
        self.worker_id = worker_id
        self.lease_s = lease_s
        self.requeue = requeue
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="datagen-heartbeat",
                                        daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.ledger.r.delete(keys.worker_alive(self.worker_id))

    def beat(self) -> None:
        self.ledger.r.set(keys.worker_alive(self.worker_id), "1",
                          px=int(self.lease_s * 1000))

    def _loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.beat()
                if self.ledger.r.set(REAPER_LOCK, self.worker_id, nx=True,
                                     px=int(self.lease_s * 500)):
                    reap(self.ledger, self.lease_s, self.requeue)
            except Exception as exc:  # Redis restarting: keep beating
                log.warning("heartbeat: %s", exc)


def reap(ledger: Ledger, lease_s: float, requeue: Callable[[Job], None]) -> int:
    """Re-enqueue in-flight samples whose worker stopped beating; returns how many."""
    now = time.time()
    count = 0
    for dataset in ledger.datasets():
        key = ledger.k(dataset, keys.INFLIGHT)
        for sample, raw in ledger.r.hgetall(key).items():
            entry = json.loads(raw)
            if now - entry.get("start", now) < lease_s:
                continue
            if ledger.r.exists(keys.worker_alive(entry.get("worker", ""))):
                continue
            # Only the reaper that removes the entry re-enqueues it.
            if not ledger.r.hdel(key, sample):
                continue
            payload = ledger.r.hget(ledger.k(dataset, keys.PENDING), sample)
            ledger.count(dataset, "reaped")
            if payload:
                requeue(Job.from_payload(json.loads(payload)))
                count += 1
            log.warning("%s/%s: worker %s died mid-request; re-enqueued", dataset, sample,
                        entry.get("worker"))
    return count


def queued_messages(ledger: Ledger, queues: tuple[str, ...] = ("short", "long")) -> int:
    """Messages waiting in the generation queues, plus unacked ones of any queue."""
    with ledger.r.pipeline(transaction=False) as pipe:
        for queue in queues:
            pipe.llen(queue)
        pipe.hlen("unacked")
        return sum(int(x) for x in pipe.execute())


def sweep(ledger: Ledger, requeue: Callable[[Job], None]) -> int:
    """Re-enqueue pending samples that are nowhere: not queued, not in flight, not done.

    Only sound when the generation queues are empty, so it checks that first: a
    message lost between an early ack and the in-flight entry (a worker killed in
    that instant) is found here at the end of a run.
    """
    if queued_messages(ledger):
        return 0
    count = 0
    for dataset in ledger.datasets():
        if ledger.closed(dataset):
            continue
        in_flight = ledger.in_flight(dataset)
        done = ledger.done_ids(dataset)
        for sample, payload in ledger.pending(dataset).items():
            if sample in in_flight or sample in done:
                continue
            requeue(Job.from_payload(json.loads(payload)))
            count += 1
    if count:
        log.warning("sweep re-enqueued %d samples whose messages were lost", count)
    return count
