"""Worker heartbeats: lease renewal, and the reaper that gives lost work back.

Tasks are acked early, so when a worker dies its in-flight samples exist only as
ledger entries, each with a lease its owner's heartbeat renews. Any live worker's
reaper reclaims entries whose lease went stale, whoever owned them, and re-enqueues
their samples ahead of fresh work; ``commit.lua`` counts a sample once however often
it runs. A reaper reaps only after a full lease of unbroken contact with Redis: after
an outage, every live worker has renewed its leases by then, so live requests are
never taken for dead ones.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

from datagen import keys
from datagen.generation.guard import abort_entries
from datagen.generation.job import Job
from datagen.generation.lease import LeaseBook
from datagen.generation.ledger import Ledger

log = logging.getLogger(__name__)

Requeue = Callable[[Job], None]


class Heartbeat:
    def __init__(self, ledger: Ledger, book: LeaseBook, lease_s: float, requeue: Requeue):
        self.ledger = ledger
        self.book = book
        self.lease_s = lease_s
        self.requeue = requeue
        self._stop = threading.Event()
        self._connected_since: float | None = None
        self._thread = threading.Thread(target=self._loop, name="datagen-heartbeat",
                                        daemon=True)

    def start(self) -> None:
        self._tick()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self.ledger.r.delete(keys.worker_alive(self.book.owner))
        except Exception as exc:  # Redis away at shutdown: the presence key just expires
            log.warning("heartbeat stop: %s", exc)

    def beat(self) -> None:
        """Presence, lease renewal and deferred releases, in that order."""
        self.ledger.r.set(keys.worker_alive(self.book.owner), "1", px=int(self.lease_s * 1000))
        for payload in self.book.renew():
            self.requeue(Job.from_payload(json.loads(payload)))

    def _loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            self._tick()

    def _tick(self) -> None:
        try:
            self.beat()
            now = time.monotonic()
            self._connected_since = self._connected_since or now
            if now - self._connected_since >= self.lease_s and self.ledger.r.set(
                    keys.REAPER_LOCK, self.book.owner, nx=True, px=int(self.lease_s * 500)):
                reap(self.ledger, self.requeue)
        except Exception as exc:  # Redis restarting: keep beating, and start over
            self._connected_since = None
            log.warning("heartbeat: %s", exc)


def reap(ledger: Ledger, requeue: Requeue) -> int:
    """Re-enqueue the samples of in-flight entries whose lease is stale; returns how many.
    Each reclaimed entry's request is aborted by its exact rid on its server first: a
    killed worker's requests otherwise decode on to their caps beside their re-runs."""
    count = 0
    for dataset in ledger.datasets():
        reaped = ledger.reap(dataset)
        abort_entries(ledger, [{"rid": g.rid, "server": g.server} for g in reaped])
        for gone in reaped:
            log.warning("%s/%s: lease of %s went stale mid-request; its request aborted, "
                        "re-enqueued", dataset, gone.sample, gone.worker or "?")
            if gone.payload:
                requeue(Job.from_payload(json.loads(gone.payload)))
                count += 1
    return count


def queued_messages(ledger: Ledger, queues: tuple[str, ...] = ("short", "long")) -> int:
    """Messages waiting in the generation queues (every priority), plus unacked ones."""
    with ledger.r.pipeline(transaction=False) as pipe:
        for queue in queues:
            for name in keys.queue_lists(queue):
                pipe.llen(name)
        pipe.hlen("unacked")
        return sum(int(x) for x in pipe.execute())


def sweep(ledger: Ledger, requeue: Requeue) -> int:
    """Re-enqueue pending samples that are nowhere: not queued, not in flight, not done;
    parked samples of a dataset with nothing in flight are woken (nothing else will).

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
        woken = [Job.from_payload(json.loads(p)) for p in
                 (ledger.unpark(dataset) if not in_flight else [])]
        for job in woken:
            requeue(job)
        count += len(woken)
        skip = (set(in_flight) | ledger.done_ids(dataset) | ledger.parked(dataset)
                | {job.sample for job in woken})
        for sample, payload in ledger.pending(dataset).items():
            if sample not in skip:
                requeue(Job.from_payload(json.loads(payload)))
                count += 1
    if count:
        log.warning("sweep re-enqueued %d samples whose messages were lost or that waited", count)
    return count
