"""How a shard's samples become forward calls: length-sorted batches, then packed rows.

A batch (at most ``batch_tokens`` tokens, longest samples first so the sizes stay even) is the
unit of retry and of one device->host copy; a row (at most ``pack_tokens``) is one forward call
over consecutive samples of a batch, concatenated without padding, position ids restarting at
0 for each (backends/hf.py says why that isolates them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def longest_first(s: Any) -> tuple[int, int]:
    """The sort key of a batch's layout: longest first, then by index."""
    return -s.length, s.idx


def length_batches(samples: Sequence[Any], batch_tokens: int) -> list[list[Any]]:
    """Samples (``.length``, ``.idx``) sorted longest first, cut at ``batch_tokens``."""
    ordered = sorted(samples, key=longest_first)
    batches: list[list[Any]] = []
    used = 0
    for s in ordered:
        if batches and used + s.length <= batch_tokens:
            batches[-1].append(s)
            used += s.length
        else:
            batches.append([s])
            used = s.length
    return batches


def pack_rows(lengths: Sequence[int], pack_tokens: int) -> list[int]:
    """Number of consecutive samples in each row (a row never exceeds pack_tokens unless one
    sample alone does; 0 gives one sample per row)."""
    rows: list[int] = []
    used = 0
    for n in lengths:
        if rows and used + n <= pack_tokens:
            rows[-1] += 1
            used += n
        else:
            rows.append(1)
            used = n
    return rows
