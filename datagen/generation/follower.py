"""Run control: follow a run until every dataset is finished, keeping it moving meanwhile.

The follower (``datagen run``, ``datagen status --watch``, the demo) redraws the status
table, and with the Celery app at hand it also keeps the run from stalling: it finishes
closes whose closer died before acting, re-enqueues pending work that is nowhere (the sweep),
and rebuilds a ledger that lost its state. Redis outages are waited out; a run is never
reported finished while the ledger has no run marker.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from rich.live import Live

from datagen.errors import LedgerUnavailable
from datagen.generation.guard import enqueue, on_closed
from datagen.generation.ledger import REDIS_AWAY, Ledger
from datagen.generation.liveness import sweep
from datagen.operations import status as status_mod

STALL_SWEEP_S = 3.0
OUTAGES = (LedgerUnavailable, *REDIS_AWAY)


class Follower:
    def __init__(self, ledger: Ledger, interval: float, app: Any = None,
                 on_lost: Callable[[], object] | None = None):
        self.ledger = ledger
        self.interval = interval
        self.app = app
        self.on_lost = on_lost
        # On a terminal the table is redrawn in place; elsewhere a line now and then.
        self.live = Live(auto_refresh=False) if sys.stdout.isatty() else None
        self._last_line = 0.0
        self._stalled_since: float | None = None

    def run(self, until_finished: bool = True, timeout_s: float | None = None
            ) -> list[status_mod.Row]:
        if self.live is None:
            return self._run(until_finished, timeout_s)
        with self.live:
            return self._run(until_finished, timeout_s)

    def _run(self, until_finished: bool, timeout_s: float | None) -> list[status_mod.Row]:
        started = time.monotonic()
        while True:
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                raise TimeoutError(f"run not finished after {timeout_s:.0f}s")
            try:
                table = self.step()
            except OUTAGES as exc:
                _say(f"Redis unreachable, waiting: {exc}")
                time.sleep(max(self.interval, 1.0))
                continue
            if table is not None and until_finished and status_mod.finished(table):
                return table
            time.sleep(self.interval)

    def step(self) -> list[status_mod.Row] | None:
        """One look at the run; None while the ledger has lost its state."""
        if self.ledger.run_marker() is None:
            _say("the ledger lost its state (no run marker)"
                 + ("; rebuilding it from the records" if self.on_lost else
                    "; `datagen recover` rebuilds it from the records"))
            if self.on_lost is not None:
                self.on_lost()
            return None
        table = status_mod.rows(self.ledger)
        self._draw(table)
        if self.app is not None:
            self._finish_closes(table)
            self._unstall(table)
        return table

    def _draw(self, table: list[status_mod.Row]) -> None:
        if self.live is not None:
            self.live.update(status_mod.table_of(table, bars=True), refresh=True)
        elif time.monotonic() - self._last_line >= max(self.interval, 10.0):
            self._last_line = time.monotonic()
            print(progress_line(table), flush=True)

    def _finish_closes(self, table: list[status_mod.Row]) -> None:
        """A closed dataset still holding pending work: whoever closed it died before the
        close's actions (revoke, drop pending, aborts) ran. Run them."""
        for row in table:
            if not (row.state.startswith("closed") and row.queued):
                continue
            reason = self.ledger.closed(row.dataset)
            if reason:
                on_closed(self.app, self.ledger, row.dataset, reason,
                          self.ledger.settings.abort_on_close)

    def _unstall(self, table: list[status_mod.Row]) -> None:
        """Samples pending while nothing runs and the queues are empty: their messages were
        lost (a worker killed right after taking one), or they wait for a wake nothing will
        send. Give them back."""
        if not status_mod.stalled(table):
            self._stalled_since = None
            return
        self._stalled_since = self._stalled_since or time.monotonic()
        if time.monotonic() - self._stalled_since > STALL_SWEEP_S:
            sweep(self.ledger, lambda job: enqueue(self.app, job, retry=True))
            self._stalled_since = None


def follow(ledger: Ledger, interval: float, until_finished: bool = True,
           app: Any = None, timeout_s: float | None = None,
           on_lost: Callable[[], object] | None = None) -> list[status_mod.Row]:
    """Redraw the status table until every dataset is finished (or forever)."""
    return Follower(ledger, interval, app, on_lost).run(until_finished, timeout_s)


def progress_line(table: list[status_mod.Row]) -> str:
    parts = [f"{r.dataset} {r.tokens:,}/{r.budget:,} ({r.percent:.0f}%, {r.state})"
             for r in table]
    return time.strftime("%H:%M:%S ") + "; ".join(parts)


def _say(text: str) -> None:
    print(time.strftime("%H:%M:%S ") + text, flush=True)
