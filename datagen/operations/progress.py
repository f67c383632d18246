"""Progress of long work: a rich progress bar (rate, ETA) redrawn on a terminal, a log line
every few seconds elsewhere.

Off a terminal rich draws nothing until the work ends, so logs (compose, systemd, CI) would
show no sign of life for the whole of a long step; there the same figures go out as a plain
log line every ``LOG_EVERY_S``.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    Task,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress
from rich.text import Text

log = logging.getLogger(__name__)

BAR_WIDTH = 24
LOG_EVERY_S = 10.0
DRAW_EVERY_S = 0.2


class RateColumn(ProgressColumn):
    """Items per second, in the work's own unit."""

    def __init__(self, unit: str):
        super().__init__()
        self.unit = unit

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text("" if speed is None else f"({speed:,.0f} {self.unit}/s)")


class Progress:
    def __init__(self, label: str, total: int | None = None, unit: str = "items",
                 stream: TextIO | None = None):
        self.label = label
        self.total = total
        self.unit = unit
        stream = stream or sys.stderr
        self.done = 0
        self.started = time.monotonic()
        self._last = 0.0
        self._bar: RichProgress | None = None
        if stream.isatty():
            self._bar = RichProgress(
                TextColumn("{task.description}"), BarColumn(bar_width=BAR_WIDTH),
                MofNCompleteColumn(), TextColumn(unit), TaskProgressColumn(),
                TextColumn("ETA"), TimeRemainingColumn(), RateColumn(unit),
                console=Console(file=stream, force_terminal=True), auto_refresh=False)
            self._task = self._bar.add_task(label, total=total)
            self._bar.start()

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self._bar is not None:
            self._bar.update(self._task, advance=n)
            if now - self._last >= DRAW_EVERY_S:
                self._last = now
                self._bar.refresh()
        elif now - self._last >= LOG_EVERY_S:
            self._last = now
            log.info("%s", self.line())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.refresh()
            self._bar.stop()

    def line(self) -> str:
        elapsed = max(1e-9, time.monotonic() - self.started)
        rate = self.done / elapsed
        text = f"{self.label}: {self.done:,}"
        if self.total:
            left = max(0, self.total - self.done)
            eta = f"{left / rate:.0f}s" if rate > 0 else "?"
            pct = min(100.0, 100.0 * self.done / self.total)
            filled = int(BAR_WIDTH * pct / 100)
            text = (f"{self.label} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] "
                    f"{self.done:,}/{self.total:,} {self.unit} {pct:.0f}% ETA {eta}")
        return f"{text} ({rate:,.0f} {self.unit}/s)"


def count_lines(paths: list) -> int:
    """Lines in the given files (a fast pass over the bytes, for a progress total)."""
    total = 0
    for path in paths:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                total += chunk.count(b"\n")
    return total
