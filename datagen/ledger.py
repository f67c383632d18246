"""The ledger: per-dataset counters, done-sets, in-flight leases and closed flags in Redis.

Every step that must be atomic across workers on many hosts is a Lua script
(``datagen/lua``): admitting a request against the budget and committing a
stored record. A sample delivered twice is stored twice at worst but counted
once, because ``commit.lua`` lets only the first commit of a sample id count.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis

from config.settings import Settings
from datagen import keys
from datagen.errors import LedgerUnavailable

log = logging.getLogger(__name__)

PRIOR_MEAN_TOKENS = 2048
MODEL_MIN_SAMPLES = 8
MODEL_POINTS = 48


@dataclass(frozen=True)
class Admission:
    status: str  # ok | closed | done | busy | wait
    committed: int
    expected_in_flight: int


@dataclass(frozen=True)
class Commit:
    committed: bool  # False: the sample was already counted (a duplicate delivery)
    tokens: int
    closed_now: bool


def _script(name: str) -> str:
    return resources.files("datagen").joinpath("lua", name).read_text(encoding="utf-8")


def connect(url: str) -> redis.Redis:
    """A client whose pool is shared by all threads of a worker process."""
    return redis.Redis.from_url(url, decode_responses=True, health_check_interval=30,
                                socket_connect_timeout=5, socket_timeout=30,
                                retry_on_timeout=True)


class Ledger:
    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.settings = settings
        self._admit = client.register_script(_script("admit.lua"))
        self._commit = client.register_script(_script("commit.lua"))

    @classmethod
    def from_settings(cls, settings: Settings) -> Ledger:
        return cls(connect(settings.redis_url), settings)

    def k(self, dataset: str, part: str) -> str:
        return keys.dataset_key(dataset, part)

    # -- set-up ---------------------------------------------------------------

    def register(self, datasets: Iterable[str]) -> None:
        """Record the run's datasets and their budgets from the settings."""
        names = list(datasets)
        if not names:
            return
        with self.r.pipeline() as pipe:
            pipe.sadd(keys.DATASETS, *names)
            pipe.hset(keys.BUDGETS, mapping={n: self.settings.budget_for(n) for n in names})
            pipe.set(keys.BUDGET_MEASURE, self.settings.budget_counts)
            pipe.execute()

    def datasets(self) -> list[str]:
        return sorted(self.r.smembers(keys.DATASETS))

    def budget(self, dataset: str) -> int:
        raw = self.r.hget(keys.BUDGETS, dataset)
        return int(raw) if raw is not None else self.settings.budget_for(dataset)

    # -- the request lifecycle --------------------------------------------------

    def admit(self, dataset: str, sample: str, rid: str, worker: str, prompt_tokens: int,
              max_new_tokens: int, precise: bool = True, server: str = "") -> Admission:
        entry = json.dumps({"rid": rid, "worker": worker, "start": time.time(), "server": server,
                            "prompt_tokens": prompt_tokens, "max_new_tokens": max_new_tokens})
        ks = [self.k(dataset, keys.CLOSED), self.k(dataset, keys.DONE),
              self.k(dataset, keys.INFLIGHT), self.k(dataset, keys.STATS), keys.BUDGETS,
              self.k(dataset, keys.MODEL)]
        args = [dataset, sample, entry, time.time(), self.settings.budget_for(dataset),
                prompt_tokens, self.settings.budget_counts, int(precise), PRIOR_MEAN_TOKENS]
        status, committed, expected = self._run(self._admit, ks, args)
        return Admission(str(status), int(committed), int(expected))

    def commit(self, dataset: str, sample: str, rid: str, prompt_tokens: int,
               completion_tokens: int, truncated: bool, latency_s: float) -> Commit:
        counted = completion_tokens
        if self.settings.budget_counts == "total":
            counted += prompt_tokens
        ks = [self.k(dataset, p) for p in (keys.DONE, keys.STATS, keys.INFLIGHT, keys.PENDING,
                                            keys.LENGTHS, keys.CLOSED)] + [keys.BUDGETS]
        args = [dataset, sample, rid, counted, prompt_tokens, completion_tokens, int(truncated),
                self.settings.budget_for(dataset), self.settings.max_samples or 0,
                keys.LENGTHS_KEPT, latency_s]
        ok, tokens, closed_now = self._run(self._commit, ks, args)
        if ok:
            self._maybe_refresh_model(dataset)
        return Commit(bool(ok), int(tokens), bool(closed_now))

    def release(self, dataset: str, sample: str, rid: str) -> None:
        """Drop an in-flight entry that did not end in a commit (failure, abort, refusal)."""
        key = self.k(dataset, keys.INFLIGHT)
        raw = self.r.hget(key, sample)
        if raw and json.loads(raw).get("rid") == rid:
            self.r.hdel(key, sample)

    def _run(self, script: Any, ks: list[str], args: list[Any]) -> Any:
        try:
            return script(keys=ks, args=args)
        except redis.exceptions.ConnectionError as exc:
            raise LedgerUnavailable(f"Redis unreachable: {exc}") from exc

    # -- the length model used by admission ---------------------------------------

    def _maybe_refresh_model(self, dataset: str) -> None:
        samples = int(self.r.hget(self.k(dataset, keys.STATS), "samples") or 0)
        if samples < MODEL_MIN_SAMPLES:
            return
        if samples > 256 and samples % 16 and self.r.exists(self.k(dataset, keys.MODEL)):
            return
        self.refresh_model(dataset)

    def refresh_model(self, dataset: str) -> dict[str, Any] | None:
        lengths = [int(x) for x in self.r.lrange(self.k(dataset, keys.LENGTHS), 0, -1)]
        stats = self.r.hgetall(self.k(dataset, keys.STATS))
        model = length_model(lengths, float(stats.get("decoded", 0)),
                             float(stats.get("decode_s", 0)))
        if model is not None:
            self.r.set(self.k(dataset, keys.MODEL), json.dumps(model))
        return model

    # -- pending work, dead letters, closing ----------------------------------------

    def add_pending(self, dataset: str, payloads: Mapping[str, str]) -> None:
        if payloads:
            self.r.hset(self.k(dataset, keys.PENDING), mapping=dict(payloads))

    def pending(self, dataset: str) -> dict[str, str]:
        return self.r.hgetall(self.k(dataset, keys.PENDING))

    def done_ids(self, dataset: str) -> set[str]:
        return set(self.r.hkeys(self.k(dataset, keys.DONE)))

    def dead_letter(self, dataset: str, sample: str, reason: str) -> None:
        entry = json.dumps({"reason": reason, "time": time.time()})
        with self.r.pipeline() as pipe:
            pipe.hset(self.k(dataset, keys.DEAD), sample, entry)
            pipe.hdel(self.k(dataset, keys.PENDING), sample)
            pipe.execute()

    def dead(self, dataset: str) -> dict[str, str]:
        return {s: json.loads(v)["reason"]
                for s, v in self.r.hgetall(self.k(dataset, keys.DEAD)).items()}

    def closed(self, dataset: str) -> str | None:
        return self.r.get(self.k(dataset, keys.CLOSED))

    def close(self, dataset: str, reason: str) -> bool:
        return bool(self.r.set(self.k(dataset, keys.CLOSED), reason, nx=True))

    def reopen(self, dataset: str) -> int:
        """Open a closed dataset again; returns the new epoch for its task stamps."""
        with self.r.pipeline() as pipe:
            pipe.delete(self.k(dataset, keys.CLOSED))
            pipe.incr(self.k(dataset, keys.EPOCH))
            _, epoch = pipe.execute()
        return int(epoch)

    def epoch(self, dataset: str) -> int:
        return int(self.r.get(self.k(dataset, keys.EPOCH)) or 0)

    def event(self, dataset: str, what: str) -> None:
        now = time.time()
        self.r.zadd(self.k(dataset, keys.EVENTS), {json.dumps({"t": now, "e": what}): now})

    def events(self, dataset: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.r.zrange(self.k(dataset, keys.EVENTS), 0, -1)]

    def set_budget(self, dataset: str, budget: int) -> None:
        self.r.hset(keys.BUDGETS, dataset, budget)

    def count(self, dataset: str, field: str, by: int = 1) -> None:
        self.r.hincrby(self.k(dataset, keys.STATS), field, by)

    def in_flight(self, dataset: str) -> dict[str, dict[str, Any]]:
        return {s: json.loads(v)
                for s, v in self.r.hgetall(self.k(dataset, keys.INFLIGHT)).items()}

    def snapshot(self, dataset: str) -> dict[str, Any]:
        """Everything status needs about one dataset, read in one round trip."""
        with self.r.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.k(dataset, keys.STATS))
            pipe.hlen(self.k(dataset, keys.PENDING))
            pipe.hlen(self.k(dataset, keys.INFLIGHT))
            pipe.hlen(self.k(dataset, keys.DEAD))
            pipe.get(self.k(dataset, keys.CLOSED))
            stats, pending, in_flight, dead, closed = pipe.execute()
        stats = {k: float(v) if "." in v else int(v) for k, v in stats.items()}
        return {"dataset": dataset, "budget": self.budget(dataset),
                "tokens": int(stats.get("tokens", 0)), "stats": stats,
                "pending": pending, "in_flight": in_flight, "dead": dead, "closed": closed}


def length_model(lengths: list[int], decoded: float, decode_s: float) -> dict[str, Any] | None:
    """Conditional-mean table for E[L | L > t], learnt from completed lengths.

    ``t`` are thresholds at quantiles, ``m[i]`` the mean of the lengths above
    ``t[i]``; ``tail`` the mean excess beyond the last threshold; ``rate`` the
    tokens per second of one request (turns elapsed time into progress).
    """
    if len(lengths) < MODEL_MIN_SAMPLES:
        return None
    xs = sorted(lengths)
    n = len(xs)
    thresholds: list[int] = []
    means: list[float] = []
    suffix = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix[i] = suffix[i + 1] + xs[i]
    step = max(1, n // MODEL_POINTS)
    for i in range(0, n - 1, step):
        t = xs[i] if i else 0
        j = _first_above(xs, t)
        if j >= n or (thresholds and t == thresholds[-1]):
            continue
        thresholds.append(t)
        means.append(suffix[j] / (n - j))
    top = xs[-max(2, n // 20):]
    tail = max(1.0, sum(top) / len(top) - top[0])
    rate = decoded / decode_s if decode_s > 0 else 50.0
    return {"t": thresholds, "m": means, "tail": tail, "mean": sum(xs) / n, "rate": rate,
            "n": n}


def _first_above(xs: list[int], t: int) -> int:
    lo, hi = 0, len(xs)
    while lo < hi:
        mid = (lo + hi) // 2
        if xs[mid] <= t:
            lo = mid + 1
        else:
            hi = mid
    return lo
