"""Worker heartbeats: lease renewal, and the reaper that gives lost work back.

Tasks are acked early, so when a worker dies its in-flight samples exist only as
ledger entries, each with a lease its owner's heartbeat renews. Any live worker's
reaper reclaims entries whose lease went stale, whoever owned them, and re-enqueues
their samples ahead of fresh work; ``commit.lua`` counts a sample once however often
it runs. A reaper reaps only right after a beat of its own reached Redis, and only once
the fleet has been in unbroken contact with Redis for a full lease (``contact.lua``):
after an outage every live worker has renewed its leases by then, so live requests are
never taken for dead ones, while a reaper started during a healthy run (a worker that
replaces a dead one) reaps at once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import redis

from datagen import keys
from datagen.generation.guard import abort_entries
from datagen.generation.job import Job
from datagen.generation.lease import LeaseBook
from datagen.generation.ledger import Ledger

log = logging.getLogger(__name__)

Requeue = Callable[[Job], None]


# The reaper lock only keeps the fleet from reaping in chorus: reap.lua gives each stale entry
# to exactly one reaper anyway. Held for one pass (or REAP_LOCK_S, if its holder dies in it).
REAP_LOCK_S = 1.0
# A reaper looks again no sooner than this after finding the lock held or a deadline passed.
REAP_RETRY_S = 0.05
# A worker beats six times a lease, and the fleet's contact mark (contact.lua) lives half a
# lease: a beat may come a third of a lease late (a loaded machine, the only worker left just
# started) before the fleet's contact starts over and every reaper waits a lease. Safe at any
# lease: a live worker renewed at most a sixth of a lease before an outage, so its leases end
# no sooner than 5/6 of a lease into it, while a contact that outlived the outage (under half
# a lease) is renewed by its next beat (a sixth, or RETRY_BEAT_S) after the heal.
BEATS_PER_LEASE = 6
# After a failed beat (Redis away), the next one comes this soon: a healed worker renews its
# leases and takes contact again within a moment of the heal, not a beat interval later.
RETRY_BEAT_S = 0.5
# While it holds requests or runs tasks, a worker checks this often that it can reach its
# server (a TCP connection, nothing asked of the server).
SERVER_PROBE_S = 1.0
# A sweep waiting for the workers' claims (their beats) reads them this often.
SWEEP_POLL_S = 0.05


class Heartbeat:
    """Beats six times a lease (presence, renewals, deferred releases) and reaps when
    the fleet's earliest lease deadline passes, not at the next beat: a dead worker's
    requests are re-enqueued within a moment of their lease's end, about one lease after
    the kill (DESIGN.md, "Acks, prefetch and the visibility timeout")."""

    def __init__(self, ledger: Ledger, book: LeaseBook, lease_s: float, requeue: Requeue,
                 server_ok: Callable[[], bool] | None = None,
                 on_server: Callable[[bool], None] | None = None):
        self.ledger = ledger
        self.book = book
        self.lease_s = lease_s
        self.requeue = requeue
        # Asked every SERVER_PROBE_S while requests are held, by a thread of its own (a probe
        # of a silent host takes its whole timeout; the beats must not wait for it): a worker
        # that cannot reach its server (a silent cut, a server host gone) ends its leases at
        # once, so a worker that can re-runs them at its next reap pass, aborting the
        # stranded requests there by rid.
        self.server_ok = server_ok
        self.on_server = on_server  # told False when the server is lost, True when back
        self._server_lock = threading.Lock()  # a renewal never follows the end of a lease
        self._stop = threading.Event()
        self._in_touch = False  # the last beat reached Redis
        self._fleet_since: float | None = None  # monotonic start of the fleet's contact
        self._next_reap = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="datagen-heartbeat",
                                        daemon=True)
        self._watcher = threading.Thread(target=self._watch, name="datagen-server-watch",
                                         daemon=True)

    @property
    def _lost(self) -> bool:
        """Whether the server was last found lost (the book's flag, which its threads read)."""
        return self.book.server_lost.is_set()

    def start(self) -> None:
        self._tick()
        self._thread.start()
        if self.server_ok is not None:
            self._watcher.start()

    def stop(self) -> None:
        self._stop.set()
        try:
            self.ledger.r.delete(keys.worker_alive(self.book.owner))
        except Exception as exc:  # Redis away at shutdown: the presence key just expires
            log.warning("heartbeat stop: %s", exc)

    def beat(self) -> None:
        """Presence, lease renewal (or, while the server is lost, their end) and deferred
        releases, in that order; then the mark of the fleet's contact, which tells since
        when the fleet has been in touch."""
        self.ledger.r.set(keys.worker_alive(self.book.owner), "1", px=int(self.lease_s * 1000))
        with self._server_lock:
            if self._lost:
                self.book.lapse()
            woken = self.book.renew(held_too=not self._lost)
        for payload in woken:
            self.requeue(Job.from_payload(json.loads(payload)))
        lasted, began = self.ledger.contact(self.lease_s / 2)
        if began and self._fleet_since is not None:
            log.warning("heartbeat: no worker reached Redis for %.1fs; reaping waits a lease "
                        "from now, so every live worker renews first", self.lease_s / 2)
        self._fleet_since = time.monotonic() - lasted

    def check_server(self) -> bool:
        """Probe the server while requests are held or tasks run (a task's retry waits on
        its server without a lease), or it was lost; on a change, one line, the leases ended
        (when lost) and ``on_server`` told. Returns whether it is reached."""
        if self.server_ok is None or not (self.book.busy() or self._lost):
            return True
        ok = self.server_ok()
        if ok != self._lost:
            return ok
        with self._server_lock:
            # set before the leases end: a lease held after this is seen by its thread
            (self.book.server_lost.clear if ok else self.book.server_lost.set)()
            if ok:
                log.info("heartbeat: the server answers again; renewing leases")
            else:
                log.warning("heartbeat: the server cannot be reached: the leases of %d "
                            "requests ended, so they run elsewhere", len(self.book))
                try:
                    self.book.lapse()
                except Exception as exc:  # Redis away too: the next beat that gets through
                    log.warning("heartbeat: leases not ended yet: %s", exc)
        if self.on_server is not None:
            self.on_server(ok)
        return ok

    def _watch(self) -> None:
        while not self._stop.wait(min(SERVER_PROBE_S, self.lease_s / BEATS_PER_LEASE)):
            try:
                self.check_server()
            except Exception as exc:  # never let the watch die: the next probe tries again
                log.warning("heartbeat: server check failed: %s", exc)

    def _loop(self) -> None:
        every = self.lease_s / BEATS_PER_LEASE
        next_beat = time.monotonic() + every
        while not self._stop.wait(max(0.0, min(next_beat, self._next_reap) - time.monotonic())):
            if time.monotonic() >= next_beat:
                self._tick()
                next_beat = time.monotonic() + (every if self._in_touch
                                                else min(RETRY_BEAT_S, every))
            else:
                self._guarded(self._reap_when_due)

    def _tick(self) -> None:
        was_in_touch, had_contact = self._in_touch, self._fleet_since is not None
        self._in_touch = self._guarded(self.beat)
        if self._in_touch and not was_in_touch and had_contact:
            log.info("heartbeat: in touch with Redis again")
        if self._in_touch:  # a reap pass only right after a beat of its own got through
            self._guarded(self._reap_when_due)

    def _guarded(self, step: Callable[[], None]) -> bool:
        try:
            step()
            return True
        except Exception as exc:  # Redis away or restarting: keep beating, reap later
            if self._in_touch:
                log.warning("heartbeat: Redis unreachable (%s); beating every %.1fs until "
                            "it answers", exc, RETRY_BEAT_S)
            self._in_touch = False
            self._next_reap = float("inf")  # the next beat that gets through decides
            return False

    def _reap_when_due(self) -> None:
        """Reap if a lease is past its deadline (under the reaper lock), then set when to
        look next: the earliest deadline still ahead, or the lock's end."""
        now = time.monotonic()
        if self._lost:  # its aborts could not reach the server: others reap, or this
            self._next_reap = float("inf")  # one at its first beat once the server is back
            return
        if not self._in_touch or self._fleet_since is None:
            self._next_reap = float("inf")  # the next beat that gets through decides
            return
        if now - self._fleet_since < self.lease_s:
            # The fleet has not been in touch for a lease: live workers may not have renewed.
            self._next_reap = self._fleet_since + self.lease_s
            return
        due_in = lease_due_in(self.ledger)
        if due_in is not None and due_in <= 0:
            if self.ledger.r.set(keys.REAPER_LOCK, self.book.owner, nx=True,
                                 px=int(REAP_LOCK_S * 1000)):
                try:
                    reap(self.ledger, self.requeue, min_contact_s=self.lease_s)
                finally:
                    release_reaper_lock(self.ledger, self.book.owner)
                due_in = lease_due_in(self.ledger)
            else:  # another reaper is at it: look again when its lock ends
                held_ms = self.ledger.r.pttl(keys.REAPER_LOCK)  # -2: gone already
                due_in = held_ms / 1000 if held_ms > 0 else 0.0
        self._next_reap = (time.monotonic() + max(REAP_RETRY_S, due_in)
                           if due_in is not None else float("inf"))


def lease_due_in(ledger: Ledger) -> float | None:
    """Seconds (Redis time) until the earliest lease deadline of any dataset, negative when
    one is past; None when nothing is in flight."""
    datasets = ledger.datasets()
    with ledger.r.pipeline(transaction=False) as pipe:
        pipe.time()
        for dataset in datasets:
            pipe.zrange(ledger.k(dataset, keys.LEASES), 0, 0, withscores=True)
        (sec, usec), *firsts = pipe.execute()
    deadlines = [first[0][1] for first in firsts if first]
    return min(deadlines) - (sec + usec / 1e6) if deadlines else None


def release_reaper_lock(ledger: Ledger, owner: str) -> None:
    """Drop the reaper lock if it is still this owner's (a slow pass may have outlived it)."""
    with ledger.r.pipeline() as pipe:
        try:
            pipe.watch(keys.REAPER_LOCK)
            if pipe.get(keys.REAPER_LOCK) == owner:
                pipe.multi()
                pipe.delete(keys.REAPER_LOCK)
                pipe.execute()
        except redis.exceptions.RedisError:  # changed meanwhile, or Redis away: it expires
            return


def reap(ledger: Ledger, requeue: Requeue, min_contact_s: float = 0.0) -> int:
    """Re-enqueue the samples of in-flight entries whose lease is stale; returns how many.
    Each reclaimed entry's request is aborted by its exact rid on its server first: a
    killed worker's requests otherwise decode on to their caps beside their re-runs.
    ``min_contact_s``: reap only after that long of the fleet's contact with Redis."""
    count = 0
    for dataset in ledger.datasets():
        reaped = ledger.reap(dataset, min_contact_s)
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


def sweep(ledger: Ledger, requeue: Requeue, wait_s: float | None = None) -> int:
    """Re-enqueue pending samples that are nowhere: not queued, not claimed by a worker's
    task, not in flight, not done; parked samples of a dataset with nothing in flight are
    woken (nothing else will). Returns how many.

    Only sound when the generation queues are empty, so it checks that first: a message
    lost between an early ack and the in-flight entry (a worker killed in that instant) is
    found here at the end of a run. A task claims its sample from the start of ``run_job``
    (``LeaseBook.running``) to its end, and every beat publishes its worker's claims: a sample
    found nowhere is re-enqueued only once every worker whose claims are up (they expire a
    lease after its last beat) has published since the sweep looked and it is still nowhere.
    What that publication holds: every task past its claim, so one on a loaded host still
    short of its admission is safe. What it does not: a task between the broker's early ack
    (in the pool's thread, before the task body) and its claim, that is Celery's trace
    set-up, the payload's parse and, on a process's first task, the building of its context;
    a sweep whose wait spans a beat taken in that gap re-enqueues the sample, and a second
    copy runs. That copy is never counted twice: in the same process it waits for the first
    (``running``) and finds it done, elsewhere admission refuses it as busy while the first
    holds the entry (or the first is refused, if the copy admits first), and ``commit.lua``
    counts a sample once; the cost is at most one extra request. Waits up to ``wait_s``
    (default a lease) for those beats; 0 when they do not come. The reads follow a sample's
    life (queued, claimed, in flight, done), so one moving on meanwhile is seen in a later
    read.
    """
    if queued_messages(ledger):
        return 0
    since = ledger.now()
    woken = _wake_parked(ledger, requeue)
    if woken:  # queued now: a later sweep looks for the lost ones
        log.warning("sweep woke %d parked samples of datasets with nothing in flight", woken)
        return woken
    lost = _nowhere(ledger)
    if not lost or not _published_since(
            ledger, since, ledger.settings.lease_s if wait_s is None else wait_s):
        return 0
    if queued_messages(ledger):
        return 0
    still = _nowhere(ledger)
    count = 0
    for dataset, payloads in lost.items():
        for sample, payload in payloads.items():
            if sample in still.get(dataset, {}):
                requeue(Job.from_payload(json.loads(payload)))
                count += 1
    if count:
        log.warning("sweep re-enqueued %d samples whose messages were lost", count)
    return count


def _wake_parked(ledger: Ledger, requeue: Requeue) -> int:
    count = 0
    for dataset in ledger.datasets():
        if ledger.closed(dataset) or ledger.in_flight(dataset):
            continue
        for payload in ledger.unpark(dataset):
            requeue(Job.from_payload(json.loads(payload)))
            count += 1
    return count


def _nowhere(ledger: Ledger) -> dict[str, dict[str, str]]:
    """Per open dataset, the pending samples (and their payloads) that are not claimed, in
    flight, done or parked."""
    claimed, _ = ledger.claims()
    out: dict[str, dict[str, str]] = {}
    for dataset in ledger.datasets():
        if ledger.closed(dataset):
            continue
        skip = (set(ledger.in_flight(dataset)) | ledger.done_ids(dataset)
                | ledger.parked(dataset) | {s for d, s in claimed if d == dataset})
        found = {s: p for s, p in ledger.pending(dataset).items() if s not in skip}
        if found:
            out[dataset] = found
    return out


def _published_since(ledger: Ledger, since: float, wait_s: float) -> bool:
    """Whether every worker whose claims are up published them after ``since`` (Redis time),
    waiting up to ``wait_s`` for their beats (a dead worker's expire meanwhile)."""
    deadline = time.monotonic() + wait_s
    while True:
        _, stamps = ledger.claims()
        if all(at >= since for at in stamps.values()):
            return True
        if time.monotonic() >= deadline:
            log.info("sweep: %d workers did not publish their claims within %.1fs; "
                     "looking again later", sum(at < since for at in stamps.values()), wait_s)
            return False
        time.sleep(SWEEP_POLL_S)
