"""The ledger's done map (sample id -> "rid tokens"), held in 24 bytes a sample.

Merge asks two things of it: is a sample committed, and is this copy's rid the one its
tokens were counted with. A dict of 2,000,000 such entries costs ~350 MB of str objects;
here a sample is a 128-bit hash of its id (sorted, binary-searched) and a 64-bit hash of
the committed rid. Two ids sharing a 128-bit hash (odds ~n^2 / 2^129: never, in practice)
would read as one.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from hashlib import blake2b
from itertools import islice

import numpy as np

SCAN_COUNT = 10_000  # fields per HSCAN reply when read from Redis
LOOKUP_BATCH = 65_536  # sids hashed and looked up at once by ``contains_all``


def sid_digest(sid: str) -> bytes:
    return _blake(sid, 16)


def rid_digest(rid: str) -> int:
    return int.from_bytes(_blake(rid, 8), "little")


def _blake(text: str, size: int) -> bytes:
    return blake2b(text.encode("utf-8", "surrogatepass"), digest_size=size).digest()


class Committed:
    """Sorted sample-id hashes with the hash of each one's committed rid."""

    def __init__(self, pairs: Iterable[tuple[str, str]]):
        sids, rids = bytearray(), array("Q")
        for sid, value in pairs:
            sids += sid_digest(sid)
            rids.append(rid_digest(value.split(" ", 1)[0]))
        keys = np.frombuffer(sids, dtype="S16") if sids else np.zeros(0, "S16")
        rid = np.frombuffer(rids, dtype=np.uint64) if rids else np.zeros(0, np.uint64)
        order = np.argsort(keys, kind="stable")
        keys, rid = keys[order], rid[order]
        # HSCAN may return a field twice (while Redis rehashes): keep one.
        first = np.ones(len(keys), dtype=bool)
        first[1:] = keys[1:] != keys[:-1]
        self._keys, self._rids = keys[first], rid[first]
        self._by_rid: np.ndarray | None = None

    @classmethod
    def of(cls, committed: Mapping[str, str] | Committed | None) -> Committed | None:
        if committed is None or isinstance(committed, Committed):
            return committed
        return cls(committed.items())

    def __len__(self) -> int:
        return len(self._keys)

    def _find(self, digest: bytes) -> int:
        at = int(np.searchsorted(self._keys, digest))
        return at if at < len(self._keys) and self._keys[at] == digest else -1

    def __contains__(self, sid: object) -> bool:
        return isinstance(sid, str) and self._find(sid_digest(sid)) >= 0

    def rid_matches(self, sid: str, rid: object) -> bool:
        """Whether ``rid`` is the rid the committed sample ``sid`` was counted with."""
        at = self._find(sid_digest(sid))
        return isinstance(rid, str) and at >= 0 and rid_digest(rid) == int(self._rids[at])

    def holds_rid(self, rid: str) -> bool:
        """Whether some sample was counted with ``rid`` (the rid hashes sorted on first use)."""
        if self._by_rid is None:
            self._by_rid = np.sort(self._rids)
        at = int(np.searchsorted(self._by_rid, np.uint64(rid_digest(rid))))
        return at < len(self._by_rid) and int(self._by_rid[at]) == rid_digest(rid)

    def contains_all(self, sids: Iterable[str]) -> np.ndarray:
        """``sid in self`` for each of ``sids``, as a bool array (1 byte a sid: the hashes
        are looked up LOOKUP_BATCH at a time)."""
        found = [np.zeros(0, dtype=bool)]
        it = iter(sids)
        while batch := list(islice(it, LOOKUP_BATCH)):
            q = np.frombuffer(b"".join(map(sid_digest, batch)), dtype="S16")
            if not len(self._keys):
                found.append(np.zeros(len(q), dtype=bool))
                continue
            at = np.minimum(np.searchsorted(self._keys, q), len(self._keys) - 1)
            found.append(self._keys[at] == q)
        return np.concatenate(found)


class KeptAttempts:
    """The rids whose captured states must stay: in flight, or counted (``Ledger.kept``)."""

    def __init__(self, in_flight: Iterable[str], committed: Committed | None):
        self._flying, self._done = set(in_flight), committed

    def __contains__(self, rid: object) -> bool:
        if not isinstance(rid, str):
            return False
        return rid in self._flying or (self._done is not None and self._done.holds_rid(rid))
