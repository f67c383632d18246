"""Fault injection for client-reliability tests (`POST /_sim/fault`).

Modes: `down` (503 on /generate and /health_generate), `error500` (500 on /generate), `reset`
(the socket is closed with a TCP reset; `"phase": "before"` drops it before any byte and never
runs the request, `"mid"` (default) runs it and resets after the status line and part of the
body), `slow` (every decode step takes `factor` times longer), `none`.
`count` limits down/error500/reset to the next N /generate calls; `duration_s` limits any mode
in time. Without either, a mode holds until set to `none`.
"""

import logging
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus

from simulator.errors import ApiError

logger = logging.getLogger(__name__)

MODES = ("none", "down", "error500", "reset", "slow")
PHASES = ("before", "mid")


@dataclass(frozen=True)
class Fault:
    """One injected failure handed to a /generate call."""

    mode: str
    phase: str = "mid"


class FaultState:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._clear()

    def set(self, spec: dict) -> dict:
        mode, count, duration_s, factor, phase = _parse(spec)
        with self._lock:
            self._clear()
            self._mode, self._count, self._factor, self._phase = mode, count, factor, phase
            if duration_s is not None:
                self._expires_at = time.monotonic() + duration_s
            logger.info("fault mode set to %s (count=%s, duration_s=%s)", mode, count, duration_s)
            return self._describe()

    def take(self) -> Fault | None:
        """The fault a /generate call must suffer now, using up one of `count`."""
        with self._lock:
            self._expire()
            if self._mode not in ("down", "error500", "reset"):
                return None
            fault = Fault(self._mode, self._phase)
            if self._count is not None:
                self._count -= 1
                if self._count <= 0:
                    self._clear()
            return fault

    def is_down(self) -> bool:
        with self._lock:
            self._expire()
            return self._mode == "down"

    def slow_factor(self) -> float:
        with self._lock:
            self._expire()
            return self._factor if self._mode == "slow" else 1.0

    def describe(self) -> dict:
        with self._lock:
            self._expire()
            return self._describe()

    def _describe(self) -> dict:
        left = None
        if self._expires_at is not None:
            left = max(0.0, self._expires_at - time.monotonic())
        return {"mode": self._mode, "count": self._count, "remaining_s": left,
                "factor": self._factor, "phase": self._phase}

    def _expire(self) -> None:
        if self._expires_at is not None and time.monotonic() >= self._expires_at:
            self._clear()

    def _clear(self) -> None:
        self._mode = "none"
        self._count: int | None = None
        self._expires_at: float | None = None
        self._factor = 1.0
        self._phase = "mid"


def _parse(spec: dict) -> tuple[str, int | None, float | None, float, str]:
    if not isinstance(spec, dict):
        raise _bad("fault body must be a JSON object")
    mode = spec.get("mode", "none")
    count = spec.get("count")
    duration_s = spec.get("duration_s")
    factor = spec.get("factor", 10.0 if mode == "slow" else 1.0)
    phase = spec.get("phase", "mid")
    if mode not in MODES:
        raise _bad(f"mode must be one of {MODES}, got {mode!r}")
    if count is not None and (not isinstance(count, int) or count < 1):
        raise _bad(f"count must be a positive integer, got {count!r}")
    if duration_s is not None and (not isinstance(duration_s, int | float) or duration_s <= 0):
        raise _bad(f"duration_s must be a positive number, got {duration_s!r}")
    if not isinstance(factor, int | float) or factor <= 0:
        raise _bad(f"factor must be a positive number, got {factor!r}")
    if phase not in PHASES:
        raise _bad(f"phase must be one of {PHASES}, got {phase!r}")
    return mode, count, duration_s, float(factor), phase


def _bad(message: str) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message)
