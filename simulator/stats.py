"""Counters behind `GET /_sim/stats`; peaks let tests prove the capacity limit held.

`peak_running` is the server's own batch cap at work; `peak_in_flight` counts every request
received and not yet answered (running or waiting), so it shows how many requests the clients
had open at once, whatever the server's cap.
"""

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
        # The engine's own clock: decode steps that produced tokens, and the simulated seconds
        # they took (time_scale included). tokens_generated / decode_s is the throughput of the
        # timing model, which a starved client or a late-waking engine thread cannot distort.
        "decode_steps",
        "decode_s",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.COUNTERS, 0)
        self._connections = 0
        self._peak_connections = 0
        self._peak_running = 0
        self._peak_in_flight = 0

    def add(self, name: str, amount: float = 1) -> None:
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

    def saw_in_flight(self, in_flight: int) -> None:
        # Called by the engine under its own lock when requests arrive. The engine drops a
        # request before its answer is written, so a client's next request never overlaps it.
        with self._lock:
            self._peak_in_flight = max(self._peak_in_flight, in_flight)

    def snapshot(self, running: int, waiting: int) -> dict:
        with self._lock:
            return {
                **self._counts,
                "running": running,
                "waiting": waiting,
                "peak_running": self._peak_running,
                "peak_in_flight": self._peak_in_flight,
                "connections": self._connections,
                "peak_connections": self._peak_connections,
            }

    def reset(self, running: int, in_flight: int) -> None:
        # Peaks restart from what is live now, not from zero, so they stay true maxima.
        with self._lock:
            self._counts = dict.fromkeys(self.COUNTERS, 0)
            self._peak_running = running
            self._peak_in_flight = in_flight
            self._peak_connections = self._connections
