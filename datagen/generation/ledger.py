"""The ledger: per-dataset counters, done-sets, in-flight leases and closed flags in Redis.

Every step that must be atomic across workers on many hosts is a Lua script
(``datagen/generation/lua``): admitting a request against the budget and committing a
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
MODEL_MIN_SAMPLES = 16
PSEUDO_CENSORED = 2
MODEL_POINTS = 96
TAIL_POINTS = 32
MODEL_REFRESH_S = 0.25


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
    return resources.files("datagen.generation").joinpath("lua", name).read_text(encoding="utf-8")


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
                prompt_tokens, self.settings.budget_counts, int(precise), PRIOR_MEAN_TOKENS,
                self.settings.admission_margin_sd]
        status, committed, expected = self._run(self._admit, ks, args)
        return Admission(str(status), int(committed), int(expected))

    def commit(self, dataset: str, sample: str, rid: str, prompt_tokens: int,
               completion_tokens: int, truncated: bool, latency_s: float) -> Commit:
        counted = completion_tokens
        if self.settings.budget_counts == "total":
            counted += prompt_tokens
        ks = [self.k(dataset, p) for p in (keys.DONE, keys.STATS, keys.INFLIGHT, keys.PENDING,
                                            keys.LENGTHS, keys.CLOSED)] + [
            keys.BUDGETS, self.k(dataset, keys.SPEEDS), self.k(dataset, keys.PROGRESS)]
        args = [dataset, sample, rid, counted, prompt_tokens, completion_tokens, int(truncated),
                self.settings.budget_for(dataset), self.settings.max_samples or 0,
                keys.LENGTHS_KEPT, latency_s, time.time()]
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
        """Refresh at most every MODEL_REFRESH_S per dataset, across all workers."""
        lock = self.k(dataset, keys.MODEL) + ":lock"
        if self.r.set(lock, "1", nx=True, px=int(MODEL_REFRESH_S * 1000)):
            self.refresh_model(dataset)

    def refresh_model(self, dataset: str) -> dict[str, Any] | None:
        lengths = [int(x) for x in self.r.lrange(self.k(dataset, keys.LENGTHS), 0, -1)]
        stats = self.r.hgetall(self.k(dataset, keys.STATS))
        decoded, decode_s = 0.0, 0.0
        for pair in self.r.lrange(self.k(dataset, keys.SPEEDS), 0, -1):
            tokens, seconds = pair.split()
            decoded, decode_s = decoded + float(tokens), decode_s + float(seconds)
        if not decode_s:
            decoded, decode_s = float(stats.get("decoded", 0)), float(stats.get("decode_s", 0))
        rate = decoded / decode_s if decode_s > 0 else None
        now = time.time()
        censored, cap = [], int(stats.get("cap", 0))
        for entry in self.in_flight(dataset).values():
            cap = max(cap, int(entry.get("max_new_tokens") or 0))
            if rate:
                progress = (now - entry["start"]) * rate
                censored.append(min(progress, entry.get("max_new_tokens") or progress))
        model = length_model(lengths, decoded, decode_s, censored, cap or None)
        if model is not None:
            self.r.set(self.k(dataset, keys.MODEL), json.dumps(model))
        return model

    # -- pending work, dead letters, closing ----------------------------------------

    def add_pending(self, dataset: str, payloads: Mapping[str, str]) -> None:
        if payloads:
            self.r.hset(self.k(dataset, keys.PENDING), mapping=dict(payloads))

    def pending(self, dataset: str) -> dict[str, str]:
        return self.r.hgetall(self.k(dataset, keys.PENDING))

    def pending_ids(self, dataset: str) -> set[str]:
        """The pending sample ids without their payloads: HKEYS moves a tenth of
        HGETALL's bytes (34 MB against 186 MB at 300,000 pending)."""
        return set(self.r.hkeys(self.k(dataset, keys.PENDING)))

    def drop_pending(self, dataset: str) -> None:
        """Forget a closed dataset's pending payloads: its queued tasks were revoked, the
        sweep skips it and a reopen enqueues anew. UNLINK frees the hash off the main
        thread (hundreds of MB at a few hundred thousand pending)."""
        self.r.unlink(self.k(dataset, keys.PENDING))

    def committed(self, dataset: str) -> dict[str, str]:
        """Sample id -> "rid tokens" of the record each sample was counted with."""
        return self.r.hgetall(self.k(dataset, keys.DONE))

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
        """Open a closed dataset again; returns the new epoch for its task stamps.

        Its queued tasks were revoked at the close, so its pending entries go too: the
        producer then enqueues everything that is missing anew.
        """
        with self.r.pipeline() as pipe:
            pipe.delete(self.k(dataset, keys.CLOSED), self.k(dataset, keys.PENDING))
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

    def tokens_per_s(self, dataset: str, window_s: float = 60.0) -> float | None:
        """Committed tokens per second over the last ``window_s`` (None: no commits in it)."""
        now = time.time()
        points = self.r.zrangebyscore(self.k(dataset, keys.PROGRESS), now - window_s, "+inf")
        if not points:
            return None
        tokens = [int(p.split("@")[0]) for p in points]
        first_t = float(points[0].split("@")[1])
        before = self.r.zrevrangebyscore(self.k(dataset, keys.PROGRESS), f"({now - window_s}",
                                         "-inf", start=0, num=1)
        start_tokens = int(before[0].split("@")[0]) if before else tokens[0]
        span = now - (now - window_s if before else first_t)
        return (tokens[-1] - start_tokens) / span if span > 0 else None

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
            pipe.hget(keys.BUDGETS, dataset)
            stats, pending, in_flight, dead, closed, budget = pipe.execute()
        stats = {k: float(v) if "." in v else int(v) for k, v in stats.items()}
        budget = int(budget) if budget is not None else self.settings.budget_for(dataset)
        return {"dataset": dataset, "budget": budget,
                "tokens": int(stats.get("tokens", 0)), "stats": stats,
                "pending": pending, "in_flight": in_flight, "dead": dead, "closed": closed}


def length_model(lengths: list[int], decoded: float, decode_s: float,
                 censored: list[float] | None = None, cap: int | None = None
                 ) -> dict[str, Any] | None:
    """Table of E[L | L > t] for admission, learnt from the dataset's own responses.

    Completed lengths alone are biased short (short responses finish first), so
    requests still in flight count as censored observations (L > progress so far)
    in a Kaplan–Meier estimate of the survival curve S. Then
    E[L | L > t] = t + (integral of S from t to the cap) / S(t). Mass that KM
    leaves beyond the longest observation is put at the cap (max_new_tokens):
    conservative, and it shrinks as requests complete.
    ``t``/``m``/``v`` are the table (threshold, conditional mean, conditional variance),
    ``tail`` the mean excess past the last threshold, ``mean``/``var`` of L, ``rate``
    tokens per second of one request (turns elapsed time into progress).
    """
    if len(lengths) < MODEL_MIN_SAMPLES:
        return None
    # Two pseudo-observations censored at the longest length seen: a few dozen samples
    # cannot rule out longer responses, so part of the mass stays up to the cap. Their
    # weight fades as samples accumulate (2 in 4,096 at most).
    longest = max(lengths)
    censored = list(censored or []) + [float(longest)] * PSEUDO_CENSORED
    points, survival = _kaplan_meier(lengths, censored)
    top = max(longest, max(censored))
    cap = max(cap or top, top)
    # Area under S and under 2u·S(u) to the right of each point (first and second
    # moments), with the leftover mass at the cap.
    areas, areas2 = [0.0] * len(points), [0.0] * len(points)
    area = survival[-1] * (cap - points[-1])
    area2 = survival[-1] * (cap * cap - points[-1] ** 2)
    for i in range(len(points) - 1, -1, -1):
        areas[i], areas2[i] = area, area2
        if i:
            area += survival[i - 1] * (points[i] - points[i - 1])
            area2 += survival[i - 1] * (points[i] ** 2 - points[i - 1] ** 2)
    mean = area + points[0]  # S = 1 on [0, first point)
    second = area2 + points[0] ** 2
    step = max(1, len(points) // MODEL_POINTS)
    # Quantile-spaced points, plus every one of the last TAIL_POINTS: the long requests
    # still in flight at the end of a dataset are the ones whose estimate decides the stop.
    picked = sorted(set(range(0, len(points), step)) |
                    set(range(max(0, len(points) - TAIL_POINTS), len(points))))
    thresholds, means, variances = [0], [mean], [max(0.0, second - mean * mean)]
    for i in picked:
        if survival[i] <= 1e-9:
            break
        m1 = points[i] + areas[i] / survival[i]
        m2 = points[i] ** 2 + areas2[i] / survival[i]
        thresholds.append(int(points[i]))
        means.append(m1)
        variances.append(max(0.0, m2 - m1 * m1))
    if cap > thresholds[-1]:
        # Past the last point a request can only end between where it is and the cap.
        thresholds.append(int(cap))
        means.append(float(cap))
        variances.append(0.0)
    tail = means[-1] - thresholds[-1]
    rate = decoded / decode_s if decode_s > 0 else 50.0
    return {"t": thresholds, "m": means, "v": variances, "tail": max(1.0, tail),
            "mean": mean, "var": variances[0], "rate": rate, "n": len(lengths),
            "censored": len(censored) - PSEUDO_CENSORED}


def _kaplan_meier(events: list[int], censored: list[float]
                  ) -> tuple[list[float], list[float]]:
    """Distinct observation points and the survival S(t) just after each."""
    obs = sorted([(float(x), 1) for x in events] + [(float(x), 0) for x in censored])
    at_risk = len(obs)
    points: list[float] = []
    survival: list[float] = []
    s = 1.0
    i = 0
    while i < len(obs):
        t = obs[i][0]
        deaths = removed = 0
        while i < len(obs) and obs[i][0] == t:
            deaths += obs[i][1]
            removed += 1
            i += 1
        if deaths:
            s *= 1.0 - deaths / at_risk
        at_risk -= removed
        points.append(t)
        survival.append(s)
    return points, survival
