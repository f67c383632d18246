"""Dead-lettered samples grouped by why they died: `datagen dead` and the run summary.

A reason is one sample's error text, and most carry numbers of their own (the prompt's
token count, a port, a request id). Samples are grouped on the reason with those masked,
so 300 prompts too long for the context make one line with a count, not 300 lines. Each
line shows one sample's reason as it was (a real path, a real port), never the masked key.
The entries are read live from the ledger: a sample that later commits leaves the list.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from datagen.generation.ledger import Ledger

# Hex request ids (new_rid) first, then every remaining number.
_HEX_ID = re.compile(r"\b(?=[0-9a-f]*\d)[0-9a-f]{12,}\b")
_NUMBER = re.compile(r"\d+")
SAMPLES_SHOWN = 10
TOP_REASONS = 5


def pattern(reason: str) -> str:
    """The reason with its sample-specific numbers masked: the key samples are grouped on."""
    return _NUMBER.sub("N", _HEX_ID.sub("<id>", reason))


@dataclass(frozen=True)
class Group:
    reason: str  # the pattern every sample of the group shares
    count: int
    example: str  # the first sample's reason in full
    samples: tuple[str, ...]


@dataclass(frozen=True)
class DatasetDead:
    dataset: str
    groups: tuple[Group, ...]

    @property
    def count(self) -> int:
        return sum(g.count for g in self.groups)


def group(dead: Mapping[str, str]) -> tuple[Group, ...]:
    """Sample id -> reason, grouped by pattern; most frequent first, then by reason."""
    members: dict[str, list[tuple[str, str]]] = {}
    for sample, reason in sorted(dead.items()):
        members.setdefault(pattern(reason), []).append((sample, reason))
    groups = [Group(key, len(items), items[0][1], tuple(s for s, _ in items))
              for key, items in members.items()]
    return tuple(sorted(groups, key=lambda g: (-g.count, g.reason)))


def read(ledger: Ledger, datasets: Iterable[str] = ()) -> list[DatasetDead]:
    """The grouped dead letters of the named datasets (all of the run's when none)."""
    known = ledger.datasets()
    names = list(datasets) or known
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown dataset {unknown[0]!r} (this run has: "
                         f"{', '.join(known) or 'none'})")
    return [DatasetDead(name, group(ledger.dead(name))) for name in names]


def as_json(table: Sequence[DatasetDead]) -> list[dict[str, Any]]:
    return [{"dataset": d.dataset, "dead": d.count,
             "reasons": [{"reason": g.reason, "count": g.count, "example": g.example,
                          "samples": list(g.samples)} for g in d.groups]}
            for d in table]


def render(table: Sequence[DatasetDead]) -> str:
    lines = []
    for d in table:
        lines.append(f"{d.dataset}: {d.count} dead" if d.count else f"{d.dataset}: none dead")
        for g in d.groups:
            lines.append(f"  {g.count:>6}  {_shown(g)}")
            shown = ", ".join(g.samples[:SAMPLES_SHOWN])
            more = len(g.samples) - SAMPLES_SHOWN
            lines.append(f"          {shown}" + (f" and {more} more" if more > 0 else ""))
    return "\n".join(lines)


def _shown(g: Group) -> str:
    """A group's line: its first sample's reason, marked as one of many when there are more."""
    return f"e.g. {g.example}" if g.count > 1 else g.example


def top(table: Sequence[DatasetDead], n: int = TOP_REASONS) -> list[tuple[str, Group]]:
    """The n largest groups over all datasets, as (dataset, group)."""
    pairs = [(d.dataset, g) for d in table for g in d.groups]
    return sorted(pairs, key=lambda p: (-p[1].count, p[0], p[1].reason))[:n]


def summary(table: Sequence[DatasetDead], n: int = TOP_REASONS) -> str:
    """A few lines for the end of a run; empty when nothing is dead."""
    total = sum(d.count for d in table)
    if not total:
        return ""
    groups = sum(len(d.groups) for d in table)
    lines = [f"dead letters: {total} samples, top reasons (`datagen dead` lists them all):"]
    lines += [f"  {g.count:>6}  {dataset}  {_shown(g)}" for dataset, g in top(table, n)]
    if groups > n:
        lines.append(f"  ... and {groups - n} more reasons")
    return "\n".join(lines)
