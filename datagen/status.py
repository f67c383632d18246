"""Where every dataset stands: one table (or JSON) read from the ledger."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from datagen.generation.ledger import Ledger

BAR_WIDTH = 20


@dataclass(frozen=True)
class Row:
    dataset: str
    state: str
    budget: int
    tokens: int
    remaining: int
    percent: float
    samples: int
    queued: int
    waiting: int  # parked: refused admission until a commit or release makes room
    in_flight: int
    dead: int
    revoked: int
    truncated: int
    tokens_per_s: float | None
    eta_s: float | None


def state_of(snap: dict[str, Any]) -> str:
    closed = snap["closed"]
    if closed == "budget":
        return "closed at budget"
    if closed:
        return f"closed ({closed})"
    if snap["in_flight"]:
        return "running"
    if snap["pending"] and snap["pending"] == snap["waiting"]:
        return "waiting"
    if snap["pending"]:
        return "queued"
    if snap["stats"].get("samples"):
        return "done"
    return "idle"


def rows(ledger: Ledger) -> list[Row]:
    """One row per dataset, with tokens/s over the last minute from the ledger."""
    out = []
    for name in ledger.datasets():
        snap = ledger.snapshot(name)
        rate = ledger.tokens_per_s(name)
        state = state_of(snap)
        if state not in ("running", "queued", "waiting"):
            rate = None  # nothing more will come: no rate, no ETA
        remaining = max(0, snap["budget"] - snap["tokens"])
        stats = snap["stats"]
        eta = eta_s(remaining, snap, rate)
        out.append(Row(name, state, snap["budget"], snap["tokens"], remaining,
                       100.0 * snap["tokens"] / snap["budget"] if snap["budget"] else 0.0,
                       int(stats.get("samples", 0)), max(0, snap["pending"] - snap["waiting"]),
                       snap["waiting"], snap["in_flight"],
                       snap["dead"], int(stats.get("revoked", 0)),
                       int(stats.get("truncated", 0)), rate, eta))
    return out


def eta_s(remaining: int, snap: dict[str, Any], rate: float | None) -> float | None:
    """Seconds until the dataset ends, whichever comes first: its budget, or its samples
    (those still to run, at the mean tokens per sample so far)."""
    if not rate or rate <= 0:
        return None
    samples = int(snap["stats"].get("samples", 0))
    left = snap["pending"] + snap["in_flight"]
    if samples and left:
        remaining = min(remaining, int(left * snap["tokens"] / samples))
    return remaining / rate


def as_json(table: Sequence[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in table]


def render(table: Sequence[Row], bars: bool = False) -> str:
    head = (f"{'dataset':<14} {'state':<17} {'tokens':>11} {'budget':>11} {'remaining':>11} "
            f"{'%':>6} "
            f"{'samples':>7} {'queued':>6} {'wait':>5} {'flight':>6} {'dead':>4} {'revoked':>7} "
            f"{'tok/s':>7} {'eta':>6}")
    lines = [head, "-" * len(head)]
    for r in table:
        lines.append(
            f"{r.dataset:<14} {r.state:<17} {r.tokens:>11,} {r.budget:>11,} {r.remaining:>11,} "
            f"{r.percent:>5.1f}% "
            f"{r.samples:>7} {r.queued:>6} {r.waiting:>5} {r.in_flight:>6} {r.dead:>4} "
            f"{r.revoked:>7} "
            f"{_num(r.tokens_per_s):>7} {_eta(r.eta_s):>6}")
        if bars:
            lines.append(f"{'':<14} {_bar(r.percent)}")
    lines.append("-" * len(head))
    lines.append(
        f"{'total':<14} {'':<17} {sum(r.tokens for r in table):>11,} "
        f"{sum(r.budget for r in table):>11,} {sum(r.remaining for r in table):>11,} "
        f"{'':>6} {sum(r.samples for r in table):>7} "
        f"{sum(r.queued for r in table):>6} {sum(r.waiting for r in table):>5} "
        f"{sum(r.in_flight for r in table):>6} "
        f"{sum(r.dead for r in table):>4} {sum(r.revoked for r in table):>7}")
    return "\n".join(lines)


def finished(table: Sequence[Row]) -> bool:
    """Nothing left to do: every dataset is closed, or has nothing queued or in flight."""
    return all(r.state.startswith("closed") and r.in_flight == 0
               or (r.queued == 0 and r.waiting == 0 and r.in_flight == 0) for r in table)


def stalled(table: Sequence[Row]) -> bool:
    """An open dataset has pending samples but nothing of it is in flight."""
    return any(not r.state.startswith("closed") and (r.queued or r.waiting)
               and not r.in_flight for r in table)


def _bar(percent: float) -> str:
    filled = min(BAR_WIDTH, int(BAR_WIDTH * percent / 100))
    return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + f"] {percent:5.1f}%"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"
