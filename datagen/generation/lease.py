"""One admitted request's hold on the ledger, and the process's book of them.

An admitted request holds a lease on its sample's in-flight entry. The worker's
heartbeat renews every lease in the book; a lease nobody renews goes stale and any
reaper reclaims it, whoever owned it. A request that ends without a commit is
released in one place, ``Lease.__exit__``: when Redis cannot be reached then, the
release is retried by the heartbeat (and, failing that, the lease simply goes stale).

Before its admission, a task claims its sample in the book (``running``): the claim lasts
the whole task, retries and their waits included, and each beat publishes the claims for the
sweep, which otherwise takes a sample between its early ack and its admission for one whose
message was lost. A second copy of a sample in the same process (a sweep's, a reaper's) waits
for the first to end: both would hold the same owner's entry, and admission lets an owner
take its own entry over.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from datagen.errors import LedgerUnavailable
from datagen.generation.ledger import Commit, Ledger

log = logging.getLogger(__name__)


class LeaseBook:
    """The leases this process holds, by dataset, and releases still to be done."""

    def __init__(self, ledger: Ledger, owner: str):
        self.ledger = ledger
        self.owner = owner
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], str] = {}
        self._unreleased: list[tuple[str, str, str]] = []
        self._lapsed: set[str] = set()  # rids of held leases ended by lapse()
        # set by the heartbeat while the server cannot be reached from here: a lease taken
        # then would only be ended, so none is used (the sample goes back to the queue)
        self.server_lost = threading.Event()
        self._runs = threading.Condition()
        self._running: set[tuple[str, str]] = set()

    @contextmanager
    def running(self, dataset: str, sample: str) -> Iterator[bool]:
        """Claim a sample for one task, waiting while another task of this process runs it;
        yields whether it waited. The heartbeat publishes the claims (``publish_claims``)."""
        key = (dataset, sample)
        waited = False
        with self._runs:
            while key in self._running:
                waited = True
                self._runs.wait()
            self._running.add(key)
        try:
            yield waited
        finally:
            with self._runs:
                self._running.discard(key)
                self._runs.notify_all()

    def busy(self) -> bool:
        """Whether a lease is held or a task runs (one waiting on its server holds none)."""
        with self._runs:
            if self._running:
                return True
        return len(self) > 0

    def publish_claims(self) -> float:
        """Publish every claim, for another lease (a task claimed meanwhile waits: the
        publication holds every task started before its stamp)."""
        with self._runs:
            return self.ledger.publish_claims(self.owner, self._running)

    def hold(self, dataset: str, sample: str, rid: str) -> Lease:
        with self._lock:
            self._held[(dataset, sample)] = rid
        return Lease(self, dataset, sample, rid)

    def forget(self, lease: Lease) -> None:
        with self._lock:
            if self._held.get((lease.dataset, lease.sample)) == lease.rid:
                del self._held[(lease.dataset, lease.sample)]
            self._lapsed.discard(lease.rid)

    def release_later(self, lease: Lease) -> None:
        with self._lock:
            self._unreleased.append((lease.dataset, lease.sample, lease.rid))

    def lapse(self, held: dict[str, list[tuple[str, str]]] | None = None) -> int:
        """End the leases held (or those given) now, without releasing them: the next reaper
        pass aborts their rids on the server and re-enqueues the samples. Returns how many."""
        held = self.held() if held is None else held
        with self._lock:  # ended from here on, even when Redis does not hear it now;
            # a lease already forgotten (abandon) has no thread left to tell
            self._lapsed.update(rid for dataset, pairs in held.items() for sample, rid in pairs
                                if self._held.get((dataset, sample)) == rid)
        return self.ledger.renew(held, lease_s=0) if held else 0

    def lapsed(self, rid: str) -> bool:
        """Whether the lease of ``rid`` was ended by lapse() (the heartbeat's, when the server
        was lost): a reaper re-runs its sample, so its own thread must not."""
        with self._lock:
            return rid in self._lapsed

    def held(self) -> dict[str, list[tuple[str, str]]]:
        out: dict[str, list[tuple[str, str]]] = defaultdict(list)
        with self._lock:
            for (dataset, sample), rid in self._held.items():
                out[dataset].append((sample, rid))
        return dict(out)

    def rids(self) -> list[str]:
        with self._lock:
            return list(self._held.values())

    def renew(self, held_too: bool = True) -> list[str]:
        """Renew every held lease (unless not ``held_too``) and retry lost releases;
        returns payloads they woke."""
        held = self.held() if held_too else {}
        if held:
            self.ledger.renew(held)
        self.publish_claims()
        with self._lock:
            todo, self._unreleased = self._unreleased, []
        woken: list[str] = []
        for i, (dataset, sample, rid) in enumerate(todo):
            try:
                woken += self.ledger.release(dataset, sample, rid)
            except LedgerUnavailable:
                with self._lock:
                    self._unreleased.extend(todo[i:])
                raise
        return woken

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


class Lease:
    """Use as a context manager: leaving it without a commit releases the entry."""

    def __init__(self, book: LeaseBook, dataset: str, sample: str, rid: str):
        self.book = book
        self.dataset = dataset
        self.sample = sample
        self.rid = rid
        self.woken: list[str] = []  # payloads of parked samples woken by the end of this one
        self._ended = False

    def commit(self, prompt_tokens: int, completion_tokens: int, truncated: bool,
               latency_s: float, server: str = "", held: bool = False,
               trainable_tokens: int | None = None) -> Commit:
        result = self.book.ledger.commit(self.dataset, self.sample, self.rid, prompt_tokens,
                                         completion_tokens, truncated, latency_s, server, held,
                                         trainable_tokens)
        if not result.lost:
            self._end()
            self.woken += result.woken
        return result

    def release(self) -> None:
        if self._ended:
            return
        self._end()
        try:
            self.woken += self.book.ledger.release(self.dataset, self.sample, self.rid)
        except LedgerUnavailable as exc:
            log.warning("release of %s/%s deferred: %s", self.dataset, self.sample, exc)
            self.book.release_later(self)

    def abandon(self) -> None:
        """End it without a release: its lease ends now and the next reaper pass reclaims it
        (aborting its rid on the server, from a worker that reaches it); with Redis away too,
        it lapses one lease after the last renewal."""
        self._end()
        try:
            self.book.lapse({self.dataset: [(self.sample, self.rid)]})
        except LedgerUnavailable as exc:
            log.warning("lease of %s/%s left to lapse: %s", self.dataset, self.sample, exc)

    def _end(self) -> None:
        self._ended = True
        self.book.forget(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
