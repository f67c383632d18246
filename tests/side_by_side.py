"""What the tests that hold the simulator beside a real server (SGLang's, vLLM's) share:
each scenario runs on both, and its observations must be equal."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

import requests


def both(pair: Sequence[Any], scenario: Callable[[Any], Any]) -> tuple[Any, Any]:
    """The scenario's observation on the real server and on the simulator, in that order."""
    real, simulated = (scenario(target) for target in pair)
    return real, simulated


def sim_started(url: str) -> Callable[[str], bool]:
    """Whether the simulator at ``url`` started the request sent with a rid (its own log)."""
    def started(rid: str) -> bool:
        log = requests.get(f"{url}/_sim/log", timeout=30).json()
        return any(r["event"] == "start" and r["rid"] == rid for r in log)
    return started


def prompt(length: int) -> list[int]:
    return [1] + [5] * (length - 1)


def rid_of(name: str) -> str:
    return f"cmp-{name}-{uuid.uuid4().hex[:8]}"
