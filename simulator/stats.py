"""Counters behind `GET /_sim/stats`; peaks let tests prove the capacity limit held."""

import threading


class Stats:
    COUNTERS = (
        "requests_started",
        "requests_finished",
        "requests_aborted",
        "requests_rejected",
        "requests_reset",
        "tokens_generated",
        "prompt_tokens",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.COUNTERS, 0)
        self._connections = 0
        self._peak_connections = 0
        self._peak_running = 0

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] += amount

    def connection_opened(self) -> None:
        with self._lock:
            self._connections += 1
            self._peak_connections = max(self._peak_connections, self._connections)

    def connection_closed(self) -> None:
        with self._lock:
            self._connections -= 1

    def saw_running(self, running: int) -> None:
        # Called by the engine under its own lock each time the running set grows.
        with self._lock:
            self._peak_running = max(self._peak_running, running)

    def snapshot(self, running: int, waiting: int) -> dict:
        with self._lock:
            return {
                **self._counts,
                "running": running,
                "waiting": waiting,
                "peak_running": self._peak_running,
                "connections": self._connections,
                "peak_connections": self._peak_connections,
            }

    def reset(self, running: int) -> None:
        # Peaks restart from what is live now, not from zero, so they stay true maxima.
        with self._lock:
            self._counts = dict.fromkeys(self.COUNTERS, 0)
            self._peak_running = running
            self._peak_connections = self._connections
