"""Helpers shared by the simulator tests: start a simulator, call it, read its counters."""

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import requests

# The repository root must be importable; pytest adds only this folder to sys.path unless the
# project's pytest settings add the root (pythonpath = ["."]).
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from simulator.server import SimulatorConfig, start_in_thread  # noqa: E402

# 100x faster than real time: a decode step is 0.2-0.4 ms, a tick (several steps) 5 ms.
FAST = {"time_scale": 0.01, "lengths": "fixed:16"}
TIMEOUT = (5, 30)


@contextlib.contextmanager
def running_sim(**overrides: object) -> Iterator[str]:
    """A simulator in this process for the duration of the block; yields its base URL."""
    url, stop = start_in_thread(SimulatorConfig(**{**FAST, **overrides}))
    try:
        yield url
    finally:
        stop()


def generate(url: str, input_ids: list[int] | None = None, session: requests.Session | None = None,
             headers: dict | None = None, **fields: object) -> requests.Response:
    body = {"input_ids": input_ids if input_ids is not None else [11, 12, 13], **fields}
    return (session or requests).post(f"{url}/generate", json=body, headers=headers,
                                      timeout=TIMEOUT)


def stats(url: str) -> dict:
    return requests.get(f"{url}/_sim/stats", timeout=TIMEOUT).json()


def log(url: str) -> list[dict]:
    return requests.get(f"{url}/_sim/log", timeout=TIMEOUT).json()


def stall(url: str) -> None:
    """Make every decode step last hours: no running request ends until it is aborted.

    Tests that need many requests open at once use it instead of answers "long enough",
    which a loaded machine that is slow to send the requests outlasts.
    """
    fault = {"mode": "slow", "factor": 1e7}
    assert requests.post(f"{url}/_sim/fault", json=fault, timeout=TIMEOUT).ok


def unstall(url: str) -> None:
    assert requests.post(f"{url}/_sim/fault", json={"mode": "none"}, timeout=TIMEOUT).ok


def in_background(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    """Run fn in a thread; the dict gets "result" or "error" when it ends."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 (handed to the test to assert on)
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def wait_until(predicate, timeout_s: float = 120.0, interval_s: float = 0.005) -> None:
    # timeout_s only bounds a wait for an event that never comes; a loaded machine is slow.
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval_s)
