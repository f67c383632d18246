"""Per-record state in flat arrays, not Python objects: what keeps merge, rebuild and prepare
within a few tens of bytes per record at millions of records.

A Python object per record (a dataclass of a dozen fields, its strings, its dict slot) costs
~0.5-0.8 KB; a column of numbers costs 8 bytes a field. ``Ids`` holds every sample id in one
buffer; ``id_order`` sorts rows by (a number, their id) exactly as Python sorts the
(number, str) pairs, without a str object per row; ``groups`` finds the rows that share a
key (a hash of the id), which the callers then look at one small group at a time.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator

import numpy as np

CHUNK = 8  # bytes of an id compared per step of ``id_order`` (8: ~10 bytes a row per step)
_ROWS_PER_GATHER = 65_536  # rows gathered at once: 65,536 x 8 x 8 bytes of indices


class Ids:
    """Every row's sample id, UTF-8 (surrogatepass) in one buffer: ~(length + 8) bytes a row."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.ends = array("Q")

    def add(self, sid: str) -> None:
        self.buf += sid.encode("utf-8", "surrogatepass")
        self.ends.append(len(self.buf))

    def __len__(self) -> int:
        return len(self.ends)

    def raw(self, row: int) -> bytes:
        start = self.ends[row - 1] if row else 0
        return bytes(self.buf[start:self.ends[row]])

    def get(self, row: int) -> str:
        return self.raw(row).decode("utf-8", "surrogatepass")

    def chunk(self, rows: np.ndarray, step: int) -> tuple[np.ndarray, np.ndarray]:
        """Bytes [step*CHUNK, (step+1)*CHUNK) of each row's id, zero-padded (as S8), and how
        many of them the id has (0..CHUNK)."""
        ends = np.frombuffer(self.ends, dtype=np.uint64)
        buf = np.frombuffer(self.buf, dtype=np.uint8) if self.buf else np.zeros(1, np.uint8)
        out = np.zeros((len(rows), CHUNK), dtype=np.uint8)
        have = np.zeros(len(rows), dtype=np.uint8)
        cols = np.arange(CHUNK)
        # a slice of rows at a time: the temporaries stay _ROWS_PER_GATHER rows long
        for a in range(0, len(rows), _ROWS_PER_GATHER):
            some = rows[a:a + _ROWS_PER_GATHER]
            starts = np.where(some > 0, ends[np.maximum(some - 1, 0)], 0).astype(np.int64)
            starts += step * CHUNK
            have[a:a + len(some)] = np.clip(ends[some].astype(np.int64) - starts, 0, CHUNK)
            at = starts[:, None] + cols
            valid = cols < have[a:a + len(some), None]
            out[a:a + len(some)] = np.where(valid, buf[np.minimum(at, len(buf) - 1)], 0)
        return out.view(f"S{CHUNK}").ravel(), have


def id_order(primary: np.ndarray, ids: Ids, rows: np.ndarray) -> np.ndarray:
    """``rows`` sorted by (primary[row], id of row) exactly as Python sorts (number, str):
    code point order is UTF-8 byte order. The ids are compared CHUNK bytes at a time, the next
    CHUNK only for rows still tied, so a long shared prefix costs steps, not memory. Rows equal
    in both keep their order (a stable sort)."""
    rows = np.asarray(rows, dtype=np.int64).copy()
    pos = np.arange(len(rows))
    label: np.ndarray = primary[rows]
    step = 0
    while len(pos) > 1:
        chunk, have = ids.chunk(rows[pos], step)
        o = np.lexsort((have, chunk, label))
        rows[pos] = rows[pos[o]]
        label, chunk, have = label[o], chunk[o], have[o]
        same = (label[1:] == label[:-1]) & (chunk[1:] == chunk[:-1]) & (have[1:] == have[:-1])
        tied = np.zeros(len(pos), dtype=bool)
        tied[1:] |= same
        tied[:-1] |= same
        # An id that ended within this chunk is a prefix of any longer one that ties with it
        # (so the shorter sorted first, by ``have``); ties that go on are ids both longer.
        going_on = tied & (have == CHUNK)
        if not going_on.any():
            break
        label = np.concatenate(([0], np.cumsum(~same)))[going_on]
        pos = pos[going_on]
        step += 1
    return rows


def groups(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows grouped by key: (rows alone with their key, rows that share one sorted by key then
    row, the start of each shared group in the latter)."""
    order = np.argsort(keys, kind="stable")
    if not len(order):
        return order, order, order
    sk = keys[order]
    new = np.ones(len(sk), dtype=bool)
    new[1:] = sk[1:] != sk[:-1]
    starts = np.flatnonzero(new)
    sizes = np.diff(np.append(starts, len(sk)))
    alone = order[starts[sizes == 1]]
    shared_mask = np.repeat(sizes > 1, sizes)
    shared = order[shared_mask]
    shared_sizes = sizes[sizes > 1]
    shared_starts = np.concatenate(([0], np.cumsum(shared_sizes)[:-1])).astype(np.int64)
    return alone, shared, shared_starts


def batches(starts: np.ndarray, total: int, size: int) -> list[tuple[int, int]]:
    """[a, b) slices of ``total`` items cut only at ``starts`` (group starts, ascending), each
    about ``size`` items (more only for a group larger than that)."""
    out = []
    a = 0
    while a < total:
        at = int(np.searchsorted(starts, a + size))
        b = int(starts[at]) if at < len(starts) else total
        out.append((a, b))
        a = b
    return out


def each(rows: np.ndarray, step: int = _ROWS_PER_GATHER) -> Iterator[int]:
    """The rows as Python ints, a slice at a time (``rows.tolist()`` whole would cost 36 bytes
    a row: a list slot and an int object each)."""
    for a in range(0, len(rows), step):
        yield from rows[a:a + step].tolist()


def frozen(column: array, dtype: type | str) -> np.ndarray:
    """A numpy view of a filled column (no copy; the column must not grow after)."""
    return np.frombuffer(column, dtype=dtype) if len(column) else np.zeros(0, dtype=dtype)
