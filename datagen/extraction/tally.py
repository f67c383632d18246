"""The run's state-check total, from what lasts: the manifests and the dead letters.

Each shard's ledger entry tallies only its last run, so a resumed or rerun shard would count
its samples once per run or not at all. The total is read instead from the durable per-sample
lines: a sample with a manifest line passed (its ``checked`` positions and ``gap``; a line
without them, or with 0 positions, was not checked); a sample dead-lettered by the check
(its letter's ``checked`` and ``gap``) and with no manifest line failed. Samples are keyed by
their idx, so a sample written twice, or failed and then passed on a rerun, counts once.
No torch here: `datagen extract` and `datagen status` read it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datagen.extraction.manifest import MANIFEST_DIR, METADATA

DEAD_LETTERS = "dead_letters.jsonl"  # in the extraction folder, one JSON line per failure
KEY = "state_check"  # in extraction.json


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSONL file; a line torn by a kill is skipped."""
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict) and isinstance(entry.get("idx"), int):
            yield entry


def _gap(entry: dict[str, Any]) -> float:
    """The line's gap; 0.0 where it is missing or not a finite number."""
    try:
        gap = float(entry.get("gap") or 0.0)
    except (TypeError, ValueError):
        return 0.0
    return gap if math.isfinite(gap) else 0.0


@dataclass(frozen=True)
class Outcome:
    failed: bool
    positions: int
    gap: float
    id: str
    nonfinite: bool = False   # failed for a NaN or inf in its states
    recaptured: bool = False  # compared with a prefill on the server (recapture.py)


def _outcomes(folder: Path) -> dict[int, Outcome]:
    """idx -> the last outcome of every sample written or failed by the check."""
    out: dict[int, Outcome] = {}
    letters = folder / DEAD_LETTERS
    if letters.is_file():
        for e in _lines(letters):
            if e.get("kind") == "sample" and "gap" in e:
                out[e["idx"]] = Outcome(True, int(e.get("checked") or 0), _gap(e),
                                        str(e["id"]), bool(e.get("nonfinite")),
                                        bool(e.get("recapture")))
    for path in sorted((folder / MANIFEST_DIR).glob("*.jsonl")):
        for e in _lines(path):  # written: it passed, whatever an earlier run found
            out[e["idx"]] = Outcome(False, int(e.get("checked") or 0), _gap(e),
                                    str(e.get("id")), False, bool(e.get("recaptured")))
    return out


def run_total(folder: Path) -> dict[str, Any]:
    """{checked, failed, nonfinite, recaptured, recapture_failed, unchecked, positions,
    worst_gap, worst_idx, worst_id} of the run (``nonfinite``: of the failed, those whose
    states held a NaN or inf; ``recaptured``: samples compared with a prefill on the server,
    ``recapture_failed`` of them differing: an alert)."""
    total: dict[str, Any] = {"checked": 0, "failed": 0, "nonfinite": 0, "recaptured": 0,
                             "recapture_failed": 0, "unchecked": 0, "positions": 0,
                             "worst_gap": 0.0, "worst_idx": None, "worst_id": None}
    for idx, o in sorted(_outcomes(folder).items()):
        total["recaptured"] += o.recaptured
        total["recapture_failed"] += o.recaptured and o.failed
        if not o.positions and not o.failed:
            total["unchecked"] += 1
            continue
        total["checked"] += 1
        total["failed"] += o.failed
        total["nonfinite"] += o.nonfinite
        total["positions"] += o.positions
        if total["worst_idx"] is None or o.gap > total["worst_gap"]:
            total.update(worst_gap=round(o.gap, 6), worst_idx=idx, worst_id=o.id)
    return total


def save(folder: Path, total: dict[str, Any]) -> bool:
    """Write ``total`` into the folder's extraction.json (False: there is none yet)."""
    from datagen.generation.records import atomic_file

    path = folder / METADATA
    if not path.is_file():
        return False
    meta = json.loads(path.read_text(encoding="utf-8"))
    meta[KEY] = total
    with atomic_file(path) as fh:
        fh.write(json.dumps(meta, indent=2) + "\n")
    return True


def saved(folder: Path) -> dict[str, Any] | None:
    """The total the last `datagen extract` wrote, if any."""
    try:
        total = json.loads((folder / METADATA).read_text(encoding="utf-8")).get(KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return total if isinstance(total, dict) else None


def describe(total: dict[str, Any]) -> str:
    """One line: what was checked, what failed and the worst gap."""
    line = (f"state check: {total['checked']:,} samples checked ({total['positions']:,} "
            f"positions), {total['failed']:,} failed")
    if total.get("nonfinite"):
        line += f" ({total['nonfinite']:,} with NaN or inf states)"
    if total["checked"]:
        line += (f", worst gap {total['worst_gap']:.3g} nats (sample idx {total['worst_idx']}, "
                 f"id {total['worst_id']!r})")
    if total.get("recapture_failed"):
        line += (f"; ALERT: {total['recapture_failed']:,} of {total['recaptured']:,} samples "
                 "re-captured by a prefill on the server differ from the states captured "
                 "while generating (dead-lettered; DESIGN.md, \"Every state checked\")")
    elif total.get("recaptured"):
        line += f"; {total['recaptured']:,} re-captured on the server, all alike"
    if total["unchecked"]:
        line += (f"; {total['unchecked']:,} samples not checked (check_states off, or records "
                 "without log-probabilities)")
    return line
