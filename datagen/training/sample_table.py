"""The admitted samples of a training set as flat arrays: ~40 bytes a sample and its id, no
object each.

``datagen prepare`` indexes every dataset's merged file into a ``SampleTable``, drops the ids
an earlier dataset took (``drop_collisions``), sorts the rows by (dataset, id) and shuffles
them with ``shuffle_order``: the permutation ``random.Random(seed).shuffle`` makes of a list,
so the order is the one a list of objects got. Each line's sha256 (32 bytes a sample, read
once, for the fingerprint) waits in a temporary file beside the training set, not in memory.
"""

from __future__ import annotations

import os
import random
import tempfile
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from datagen.generation.columns import Ids, frozen, groups

DIGEST = 32  # bytes of a line's sha256


@dataclass(frozen=True)
class Entry:
    """One sample of the table as an object (made for one record at a time)."""

    dataset: str
    id: str
    offset: int   # byte offset of the record in the dataset's raw_responses.jsonl
    prompt_tokens: int
    output_tokens: int


class SampleTable:
    """The admitted samples of every dataset, one row each in flat columns (no object per
    sample): rows in (dataset in name order, line of its merged file) order. A context
    manager: the digests' temporary file goes with it."""

    def __init__(self, spill_dir: str | Path) -> None:
        self.datasets: list[str] = []
        self.dataset = array("H")
        self.offset = array("Q")
        self.prompt_tokens = array("I")
        self.output_tokens = array("I")
        self.key = array("q")  # hash(id), this process's: rows that may share an id
        self.ids = Ids()
        self.kept = np.zeros(0, dtype=np.int64)  # rows left once collisions are dropped
        Path(spill_dir).mkdir(parents=True, exist_ok=True)
        self._digests = tempfile.TemporaryFile(prefix=".digests-", dir=spill_dir)

    def add(self, dataset: int, entry: Entry, digest: bytes) -> None:
        self.dataset.append(dataset)
        self.offset.append(entry.offset)
        self.prompt_tokens.append(entry.prompt_tokens)
        self.output_tokens.append(entry.output_tokens)
        self.key.append(hash(entry.id))
        self._digests.write(digest)
        self.ids.add(entry.id)

    def __len__(self) -> int:
        return len(self.offset)

    def __enter__(self) -> SampleTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self._digests.close()

    def free(self) -> None:
        """Give the columns' memory back (the dataset names stay)."""
        for name in ("dataset", "offset", "prompt_tokens", "output_tokens", "key"):
            setattr(self, name, array(getattr(self, name).typecode))
        self.ids = Ids()
        self.kept = np.zeros(0, dtype=np.int64)

    def entry(self, row: int) -> Entry:
        return Entry(self.datasets[self.dataset[row]], self.ids.get(row), self.offset[row],
                     self.prompt_tokens[row], self.output_tokens[row])

    def digest(self, row: int) -> bytes:
        """The sha256 of the row's record line (from the temporary file)."""
        self._digests.flush()  # (no-op once the table is filled)
        return os.pread(self._digests.fileno(), DIGEST, DIGEST * row)

    def tokens(self, rows: np.ndarray) -> int:
        return int(frozen(self.prompt_tokens, np.uint32)[rows].sum(dtype=np.uint64)
                   + frozen(self.output_tokens, np.uint32)[rows].sum(dtype=np.uint64))


def drop_collisions(table: SampleTable, counts: list[Any]) -> list[tuple[str, str, str]]:
    """An id admitted by an earlier dataset drops the later copies: their rows leave the
    table's ``kept`` and their counts their dataset's. Returns (id, kept in, dropped from) in
    the order the dropped copies come. The id hashes are freed after (8 bytes a row back
    before the sort)."""
    alone, shared, starts = groups(frozen(table.key, np.int64))
    del alone
    table.key = array("q")
    dropped: list[tuple[int, str, str, str]] = []
    bounds = [*starts.tolist(), len(shared)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        owner: dict[bytes, int] = {}
        for row in sorted(shared[a:b].tolist()):
            first = owner.setdefault(table.ids.raw(row), row)
            if first != row:  # the same id (not only the same hash) in an earlier dataset
                e = table.entry(row)
                dropped.append((row, e.id, table.datasets[table.dataset[first]], e.dataset))
                count = counts[table.dataset[row]]
                count.collisions += 1
                count.samples -= 1
                count.prompt_tokens -= e.prompt_tokens
                count.output_tokens -= e.output_tokens
    dropped.sort()
    kept = np.ones(len(table), dtype=bool)
    kept[[row for row, *_ in dropped]] = False
    table.kept = np.flatnonzero(kept)
    return [(sid, owner_ds, ds) for _, sid, owner_ds, ds in dropped]


def shuffle_order(n: int, seed: int) -> np.ndarray:
    """The permutation ``random.Random(seed).shuffle`` makes of n items (its own loop, on an
    array of 8 bytes an item instead of a list of objects)."""
    perm = array("q", range(n))
    randbelow = random.Random(seed)._randbelow  # what Random.shuffle draws with
    for i in reversed(range(1, n)):
        j = randbelow(i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return frozen(perm, np.int64)
