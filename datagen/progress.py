"""Progress of long work: a redrawn bar with rate and ETA on a terminal, a log line every
few seconds elsewhere (so logs stay line-oriented and quiet)."""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger(__name__)

BAR_WIDTH = 24
LOG_EVERY_S = 10.0
DRAW_EVERY_S = 0.2


class Progress:
    def __init__(self, label: str, total: int | None = None, unit: str = "items",
                 stream: TextIO | None = None):
        self.label = label
        self.total = total
        self.unit = unit
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self.done = 0
        self.started = time.monotonic()
        self._last = 0.0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= (DRAW_EVERY_S if self.live else LOG_EVERY_S):
            self._last = now
            self._emit(final=False)

    def close(self) -> None:
        self._emit(final=True)

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

    def _emit(self, final: bool) -> None:
        if self.live:
            self.stream.write("\r" + self.line() + ("\n" if final else ""))
            self.stream.flush()
        elif not final:
            log.info("%s", self.line())


def count_lines(paths: list) -> int:
    """Lines in the given files (a fast pass over the bytes, for a progress total)."""
    total = 0
    for path in paths:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 20):
                total += chunk.count(b"\n")
    return total
