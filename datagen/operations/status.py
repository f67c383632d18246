"""Where every dataset stands: one table (or JSON) read from the ledger."""

from __future__ import annotations

import io
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from datagen.generation.ledger import Ledger

BAR_WIDTH = 10
DEFAULT_WIDTH = 100


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
    generated: int = 0  # every token the committed samples generated (tokens: the budget's)


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
                       int(stats.get("truncated", 0)), rate, eta,
                       int(stats.get("completion_tokens", 0))))
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


@dataclass(frozen=True)
class Column:
    head: str
    cell: Callable[[Row], str]
    total: Callable[[Sequence[Row]], str] | None = None
    numeric: bool = True


def _sum(attr: str, fmt: str = "{:,}") -> Callable[[Sequence[Row]], str]:
    return lambda table: fmt.format(sum(getattr(r, attr) for r in table))


COLUMNS = (
    Column("dataset", lambda r: r.dataset, lambda t: "total", numeric=False),
    Column("state", lambda r: r.state, numeric=False),
    Column("tokens", lambda r: f"{r.tokens:,}", _sum("tokens")),
    Column("budget", lambda r: f"{r.budget:,}", _sum("budget")),
    Column("generated", lambda r: f"{r.generated:,}", _sum("generated")),
    Column("remaining", lambda r: f"{r.remaining:,}", _sum("remaining")),
    Column("%", lambda r: f"{r.percent:.1f}%"),
    Column("samples", lambda r: f"{r.samples:,}", _sum("samples")),
    Column("queued", lambda r: f"{r.queued:,}", _sum("queued")),
    Column("wait", lambda r: f"{r.waiting:,}", _sum("waiting")),
    Column("flight", lambda r: f"{r.in_flight:,}", _sum("in_flight")),
    Column("dead", lambda r: f"{r.dead:,}", _sum("dead")),
    Column("revoked", lambda r: f"{r.revoked:,}", _sum("revoked")),
    Column("tok/s", lambda r: _num(r.tokens_per_s)),
    Column("eta", lambda r: _eta(r.eta_s)),
)
# Dropped first, one by one, when the table is wider than the terminal (--json keeps all).
OPTIONAL = ("remaining", "revoked", "generated", "tok/s", "dead", "%", "wait", "eta", "queued")


def width() -> int:
    """The terminal's width on a terminal, else 100 columns (logs, pipes, CI)."""
    if sys.stdout.isatty():
        return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns
    return DEFAULT_WIDTH


GAP = 2  # spaces between columns


def table_of(table: Sequence[Row], bars: bool = False, columns: int | None = None) -> Table:
    """The status table as a rich renderable. Optional columns go, one by one, until it fits
    in ``columns``; past that only the dataset and state columns are cut (with an ellipsis)."""
    columns = columns or width()
    shown = list(COLUMNS)
    for head in OPTIONAL:
        if _natural_width(table, shown, bars) <= columns:
            break
        if not (bars and head == "%"):  # the progress bars live in the % column
            shown = [c for c in shown if c.head != head]
    return _grid(table, shown, bars)


def render(table: Sequence[Row], bars: bool = False, columns: int | None = None) -> str:
    console = _console(columns or width())
    with console.capture() as captured:
        console.print(table_of(table, bars, console.width))
    return "\n".join(line.rstrip() for line in captured.get().rstrip("\n").splitlines())


def _cells(table: Sequence[Row], col: Column, bars: bool) -> list[str]:
    cells = [col.cell(r) for r in table]
    if bars and col.head == "%":
        cells = [f"{_bar(r.percent)} {r.percent:5.1f}%" for r in table]
    return [col.head, *cells, col.total(table) if col.total else ""]


def _natural_width(table: Sequence[Row], shown: list[Column], bars: bool) -> int:
    return (sum(max(map(len, _cells(table, c, bars))) for c in shown)
            + GAP * (len(shown) - 1))


def _grid(table: Sequence[Row], shown: list[Column], bars: bool) -> Table:
    grid = Table(box=box.SIMPLE_HEAD, show_edge=False, show_footer=True, pad_edge=False,
                 padding=(0, GAP - 1, 0, 0), collapse_padding=True, header_style="",
                 footer_style="")
    cells = [_cells(table, c, bars) for c in shown]
    for col, column_cells in zip(shown, cells, strict=True):
        fixed = max(map(len, column_cells)) if col.numeric else None
        grid.add_column(col.head, column_cells[-1], min_width=fixed, no_wrap=True,
                        justify="right" if col.numeric else "left", overflow="ellipsis")
    for i in range(len(table)):
        grid.add_row(*(column_cells[1 + i] for column_cells in cells))
    return grid


def _console(columns: int) -> Console:
    return Console(width=columns, color_system=None, force_terminal=False, highlight=False,
                   emoji=False, file=io.StringIO())


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
    return "#" * filled + "." * (BAR_WIDTH - filled)


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
