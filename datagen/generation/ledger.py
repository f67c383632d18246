"""The ledger: per-dataset counters, done-sets, in-flight leases and closed flags in Redis.

Every step that must be atomic across workers on many hosts is a Lua script
(``datagen/generation/lua``, each prefixed with ``_lib.lua``): admitting a request
against the budget, committing a stored record, releasing, renewing and reclaiming
leases, waking parked samples. A sample delivered twice is stored twice at worst but
counted once, because ``commit.lua`` lets only the first commit of a sample id count.
Scripts read time from Redis, so hosts with skewed clocks agree.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from typing import TYPE_CHECKING, Any

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from config.settings import Settings, masked_url
from datagen import keys
from datagen.errors import LedgerUnavailable
from datagen.generation.admission import (
    PRIOR_MEAN_TOKENS,
    PRIOR_TOKENS_PER_S,
    Bucket,
    censored_progress,
    encode_model,
    length_model,
    read_buckets,
    stored,
)

if TYPE_CHECKING:
    from datagen.generation.committed import Committed, KeptAttempts

__all__ = ["Admission", "Commit", "Ledger", "Reclaimed", "connect", "length_model", "owner_id"]

log = logging.getLogger(__name__)

MODEL_REFRESH_S = 0.25
# Most parked samples one commit or release wakes: as many as fit in the budget then.
WAKE_MAX = 8
REAP_BATCH = 500


@dataclass(frozen=True)
class Admission:
    status: str  # ok | closed | done | busy | wait | lost
    committed: int
    expected_in_flight: int
    closed_now: bool = False


@dataclass(frozen=True)
class Commit:
    committed: bool  # False: the sample was already counted (a duplicate delivery)
    tokens: int
    closed_now: bool
    woken: list[str] = field(default_factory=list)  # payloads of parked samples to enqueue
    lost: bool = False  # no run marker: nothing was written, hold the commit
    lapsed: bool = False  # ``held`` and the entry was not the rid's: not counted


@dataclass(frozen=True)
class Reclaimed:
    dataset: str
    sample: str
    payload: str  # "" when nothing is to be re-enqueued (closed dataset, no pending)
    worker: str
    rid: str = ""
    server: str = ""  # masked, as the entry holds it


def _script(name: str) -> str:
    folder = resources.files("datagen.generation").joinpath("lua")
    return (folder.joinpath("_lib.lua").read_text(encoding="utf-8") + "\n"
            + folder.joinpath(name).read_text(encoding="utf-8"))


# What "Redis is away" looks like to a client: refused or reset (ConnectionError), or a
# silent network that lets a connect or a reply time out (TimeoutError, not a subclass).
REDIS_AWAY = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
SOCKET_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 3.0


def connect(url: str) -> redis.Redis:
    """A client whose pool is shared by all threads of a worker process.

    Every ledger call takes milliseconds, so a silent network (packets dropped, no reset)
    shows within seconds: a reply waits at most SOCKET_TIMEOUT_S, a connect
    CONNECT_TIMEOUT_S, with two quick retries; TCP keepalive finds a dead peer on an idle
    connection. Longer outages are waited out above, where the step is known (the runner's
    commits and admissions, the heartbeat)."""
    tcp = {} if url.startswith("unix:") else {"socket_keepalive": True}
    return redis.Redis.from_url(url, decode_responses=True, health_check_interval=30,
                                socket_connect_timeout=CONNECT_TIMEOUT_S,
                                socket_timeout=SOCKET_TIMEOUT_S,
                                retry=Retry(ExponentialBackoff(cap=0.5, base=0.1), 2), **tcp)


def owner_id(host: str, pid: int) -> str:
    """Unique per process start: a restarted container keeps its host name and pid."""
    return f"{host}-{pid}-{secrets.token_hex(3)}"


class Ledger:
    SCRIPTS = ("admit", "commit", "release", "renew", "reap", "unpark", "contact", "claims")

    def __init__(self, client: redis.Redis, settings: Settings):
        self.r = client
        self.settings = settings
        self._scripts = {name: client.register_script(_script(f"{name}.lua"))
                         for name in self.SCRIPTS}

    @classmethod
    def from_settings(cls, settings: Settings) -> Ledger:
        return cls(connect(settings.redis_url), settings)

    def k(self, dataset: str, part: str) -> str:
        return keys.dataset_key(dataset, part)

    # -- set-up and identity ------------------------------------------------------

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

    def run_marker(self) -> dict[str, Any] | None:
        """The ledger's identity, or None when Redis lost (or never had) the run's state."""
        raw = self._call(self.r.get, keys.RUN)
        return json.loads(raw) if raw else None

    def mark_run(self) -> bool:
        """Write the run marker if absent (after the state is complete); True if written."""
        marker = json.dumps({"id": secrets.token_hex(8), "created": time.time()})
        return bool(self._call(self.r.set, keys.RUN, marker, nx=True))

    def unmark_run(self) -> None:
        """Pause the fleet's ledger writes (``recover`` rebuilds in the meantime)."""
        self._call(self.r.delete, keys.RUN)

    def datasets(self) -> list[str]:
        return sorted(self.r.smembers(keys.DATASETS))

    def budget(self, dataset: str) -> int:
        raw = self.r.hget(keys.BUDGETS, dataset)
        return int(raw) if raw is not None else self.settings.budget_for(dataset)

    # -- the request lifecycle --------------------------------------------------

    def admit(self, dataset: str, sample: str, rid: str, worker: str, prompt_tokens: int,
              max_new_tokens: int, precise: bool = True, server: str = "") -> Admission:
        ks = [keys.RUN] + [self.k(dataset, p) for p in (
            keys.CLOSED, keys.DONE, keys.INFLIGHT, keys.STATS)] + [keys.BUDGETS] + [
            self.k(dataset, p) for p in (keys.MODEL, keys.BUCKETS, keys.LEASES, keys.PARKED)]
        args = [dataset, sample, rid, worker, masked_url(server) if server else "",
                prompt_tokens, max_new_tokens, self.settings.budget_counts, int(precise),
                PRIOR_TOKENS_PER_S, self.settings.admission_margin_sd,
                self.settings.budget_for(dataset), self.settings.lease_s, PRIOR_MEAN_TOKENS]
        status, committed, expected, closed_now = self._run("admit", ks, args)
        return Admission(str(status), int(committed), int(expected), bool(closed_now))

    def commit(self, dataset: str, sample: str, rid: str, prompt_tokens: int,
               completion_tokens: int, truncated: bool, latency_s: float,
               server: str = "", held: bool = False,
               trainable_tokens: int | None = None) -> Commit:
        """Count a stored record. ``held``: only while ``rid`` still holds the sample's
        in-flight entry (captured states: see commit.lua); else ``Commit.lapsed``.
        ``trainable_tokens``: the generated tokens inside train_max_length, what
        budget_counts = "trainable" counts (None: all of them)."""
        counted = completion_tokens
        if self.settings.budget_counts == "total":
            counted += prompt_tokens
        elif self.settings.budget_counts == "trainable" and trainable_tokens is not None:
            counted = trainable_tokens
        ks = [keys.RUN] + [self.k(dataset, p) for p in (
            keys.DONE, keys.STATS, keys.INFLIGHT, keys.PENDING, keys.LENGTHS, keys.CLOSED)] + [
            keys.BUDGETS] + [self.k(dataset, p) for p in (
                keys.SPEEDS, keys.PROGRESS, keys.BUCKETS, keys.LEASES, keys.PARKED, keys.DEAD,
                keys.MODEL_LOCK)] + [
            keys.SERVER_REQUESTS, keys.SERVER_LATENCY_S, keys.SERVER_TOKENS,
            self.k(dataset, keys.MODEL)]
        args = [dataset, sample, rid, counted, prompt_tokens, completion_tokens, int(truncated),
                self.settings.budget_for(dataset), self.settings.max_samples or 0,
                keys.LENGTHS_KEPT, latency_s, masked_url(server or self.settings.server_url),
                WAKE_MAX, int(MODEL_REFRESH_S * 1000), *self._wake_args(), int(held)]
        status, tokens, closed_now, refresh, *woken = self._run("commit", ks, args)
        if status == "lost":
            return Commit(False, 0, False, lost=True)
        if status == "lapsed":
            return Commit(False, int(tokens), False, lapsed=True)
        if refresh:
            self.refresh_model(dataset)
        return Commit(status == "ok", int(tokens), bool(closed_now), list(woken))

    def release(self, dataset: str, sample: str, rid: str) -> list[str]:
        """Drop an in-flight entry that did not end in a commit, if this rid still holds it;
        returns the payloads of parked samples woken into the freed slot."""
        ks = [self.k(dataset, p) for p in (keys.INFLIGHT, keys.BUCKETS, keys.LEASES,
                                            keys.PARKED, keys.PENDING, keys.CLOSED,
                                            keys.STATS)] + [
            keys.BUDGETS, self.k(dataset, keys.MODEL)]
        args = [sample, rid, WAKE_MAX, dataset, self.settings.budget_for(dataset)]
        released, *woken = self._run("release", ks, args + self._wake_args())
        return list(woken) if released else []

    def may_continue(self, dataset: str, sample: str, rid: str) -> str:
        """Whether an admitted multi-turn sample may start its next turn: "ok", "closed"
        (its dataset closed since) or "lost" (its entry is not this rid's any more: reaped,
        or the ledger lost its state)."""
        with self.r.pipeline(transaction=False) as pipe:
            pipe.exists(self.k(dataset, keys.CLOSED))
            pipe.hget(self.k(dataset, keys.INFLIGHT), sample)
            closed, held = self._call(pipe.execute)
        if closed:
            return "closed"
        if not held or json.loads(held).get("rid") != rid:
            return "lost"
        return "ok"

    def _wake_args(self) -> list[Any]:
        return [PRIOR_TOKENS_PER_S, PRIOR_MEAN_TOKENS, self.settings.budget_counts,
                self.settings.admission_margin_sd, int(self.settings.precise_admission)]

    def renew(self, held: Mapping[str, Sequence[tuple[str, str]]],
              lease_s: float | None = None) -> int:
        """Renew the leases of this owner's requests: dataset -> [(sample, rid)], for
        ``lease_s`` (default the setting; 0 ends them now: any reaper reclaims them)."""
        script = self._scripts["renew"]
        lease_s = self.settings.lease_s if lease_s is None else lease_s
        with self.r.pipeline(transaction=False) as pipe:
            for dataset, pairs in held.items():
                args = [lease_s] + [x for pair in pairs for x in pair]
                script(keys=[self.k(dataset, keys.INFLIGHT), self.k(dataset, keys.LEASES)],
                       args=args, client=pipe)
            return sum(int(x) for x in self._call(pipe.execute))

    def publish_claims(self, owner: str, running: Iterable[tuple[str, str]]) -> float:
        """Replace this owner's published claims with ``running``, for a lease; returns
        the Redis time they were stamped with."""
        members = [json.dumps([dataset, sample]) for dataset, sample in running]
        return float(self._run("claims", [keys.worker_claims(owner)],
                               [int(self.settings.lease_s * 1000), *members]))

    def claims(self) -> tuple[set[tuple[str, str]], dict[str, float]]:
        """Every (dataset, sample) a worker's task runs now, by the workers' last
        publications, and when each worker whose claims are up (a live worker's: they expire
        a lease after its last beat) published them."""
        found: set[tuple[str, str]] = set()
        stamps: dict[str, float] = {}
        prefix = len(keys.worker_claims(""))
        for key in self.r.scan_iter(match=keys.CLAIMS_MATCH, count=1000):
            fields = self.r.hgetall(key)
            if not fields:  # expired meanwhile
                continue
            stamps[key[prefix:]] = float(fields.pop(keys.CLAIMS_AT, 0.0))
            found.update(tuple(json.loads(m)) for m in fields)
        return found, stamps

    def now(self) -> float:
        """Redis's time (the clock of every stamp and lease)."""
        seconds, micros = self.r.time()
        return seconds + micros / 1e6

    def reap(self, dataset: str, min_contact_s: float = 0.0) -> list[Reclaimed]:
        """Reclaim the dataset's in-flight entries whose lease is stale, whoever owns them;
        with ``min_contact_s``, only when the fleet has been in touch with Redis that long
        (contact.lua), checked when the script runs."""
        ks = [self.k(dataset, p) for p in (keys.INFLIGHT, keys.BUCKETS, keys.LEASES,
                                            keys.PENDING, keys.STATS, keys.CLOSED)]
        flat = self._run("reap", [*ks, keys.CONTACT_SINCE], [REAP_BATCH, min_contact_s])
        return [Reclaimed(dataset, *flat[i:i + 5]) for i in range(0, len(flat), 5)]

    def contact(self, ttl_s: float) -> tuple[float, bool]:
        """Mark the fleet's contact with Redis (contact.lua); returns how long (s, Redis
        time) the current stretch of contact has lasted, and whether this mark began it."""
        since, now, began = self._run("contact", [keys.CONTACT_SINCE],
                                      [max(1, int(ttl_s * 1000))])
        return float(now) - float(since), bool(int(began))

    def unpark(self, dataset: str, count: int = 0) -> list[str]:
        """Wake ``count`` parked samples (0: all); returns their payloads to enqueue."""
        ks = [self.k(dataset, p) for p in (keys.PARKED, keys.PENDING, keys.CLOSED)]
        return list(self._run("unpark", ks, [count]))

    def parked(self, dataset: str) -> set[str]:
        return set(self.r.zrange(self.k(dataset, keys.PARKED), 0, -1))

    def _run(self, name: str, ks: list[str], args: list[Any]) -> Any:
        return self._call(self._scripts[name], keys=ks, args=args)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except REDIS_AWAY as exc:
            raise LedgerUnavailable(f"Redis unreachable: {exc}") from exc

    # -- the length model used by admission ---------------------------------------

    def refresh_model(self, dataset: str) -> dict[str, Any] | None:
        """Learn the length model from completed lengths and the in-flight buckets."""
        with self.r.pipeline(transaction=False) as pipe:
            pipe.lrange(self.k(dataset, keys.LENGTHS), 0, -1)
            pipe.hgetall(self.k(dataset, keys.STATS))
            pipe.lrange(self.k(dataset, keys.SPEEDS), 0, -1)
            pipe.hgetall(self.k(dataset, keys.BUCKETS))
            pipe.time()
            raw_lengths, stats, speeds, buckets, (sec, usec) = pipe.execute()
        rate = decode_rate(speeds, stats)
        model = length_model([int(x) for x in raw_lengths], rate or 0.0, 1.0 if rate else 0.0,
                             censored_progress(buckets, sec + usec / 1e6, rate),
                             int(stats.get("cap", 0)) or None,
                             self.settings.admission_min_responses)
        if model is not None:
            with self.r.pipeline(transaction=False) as pipe:
                pipe.set(self.k(dataset, keys.MODEL), encode_model(model))
                pipe.set(self.k(dataset, keys.MODEL_JSON), json.dumps(stored(model)))
                pipe.execute()
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
        self.r.unlink(self.k(dataset, keys.PENDING), self.k(dataset, keys.PARKED))

    def committed(self, dataset: str) -> dict[str, str]:
        """Sample id -> "rid tokens" of the record each sample was counted with."""
        return self.r.hgetall(self.k(dataset, keys.DONE))

    def committed_index(self, dataset: str) -> Committed | None:
        """``committed`` in 24 bytes a sample (``committed.Committed``), read with HSCAN in
        replies of SCAN_COUNT fields; None when nothing is committed."""
        from datagen.generation.committed import SCAN_COUNT, Committed  # noqa: PLC0415 (numpy)

        found = Committed(self.r.hscan_iter(self.k(dataset, keys.DONE), count=SCAN_COUNT))
        return found if len(found) else None

    def kept(self, dataset: str) -> KeptAttempts:
        """The attempts whose captured states must stay (``capture.prune``): the rids in flight,
        then the committed ones, each read with HSCAN. In that order the two reads are one
        consistent view: an attempt that commits while the in-flight entries are read is in the
        done map before it is read (a capture's commit needs its in-flight entry: commit.lua),
        and one whose entry went otherwise (released, reaped) is never counted."""
        from datagen.generation.committed import SCAN_COUNT, KeptAttempts  # noqa: PLC0415

        flight = self.r.hscan_iter(self.k(dataset, keys.INFLIGHT), count=SCAN_COUNT)
        flying = [str(json.loads(raw).get("rid")) for _, raw in flight]
        return KeptAttempts(flying, self.committed_index(dataset))

    def done_ids(self, dataset: str) -> set[str]:
        return set(self.r.hkeys(self.k(dataset, keys.DONE)))

    def dead_letter(self, dataset: str, sample: str, reason: str) -> None:
        """Give up on a sample (a later commit of it clears the entry), in one round trip."""
        entry = json.dumps({"reason": reason, "time": time.time()})
        with self.r.pipeline() as pipe:
            pipe.hset(self.k(dataset, keys.DEAD), sample, entry)
            pipe.hdel(self.k(dataset, keys.PENDING), sample)
            pipe.hincrby(self.k(dataset, keys.STATS), "dead", 1)
            self._call(pipe.execute)

    def dead(self, dataset: str) -> dict[str, str]:
        return {s: json.loads(v)["reason"]
                for s, v in self.r.hgetall(self.k(dataset, keys.DEAD)).items()}

    def closed(self, dataset: str) -> str | None:
        return self.r.get(self.k(dataset, keys.CLOSED))

    def close(self, dataset: str, reason: str) -> bool:
        """Set the closed flag (first reason wins); its parked samples need no waking."""
        with self.r.pipeline() as pipe:
            pipe.set(self.k(dataset, keys.CLOSED), reason, nx=True)
            pipe.delete(self.k(dataset, keys.PARKED))
            closed, _ = pipe.execute()
        return bool(closed)

    def reopen(self, dataset: str) -> int:
        """Open a closed dataset again; returns the new epoch for its task stamps.

        Its queued tasks were revoked at the close, so its pending entries go too: the
        producer then enqueues everything that is missing anew.
        """
        with self.r.pipeline() as pipe:
            pipe.delete(self.k(dataset, keys.CLOSED), self.k(dataset, keys.PENDING),
                        self.k(dataset, keys.PARKED))
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
        self._call(self.r.hincrby, self.k(dataset, keys.STATS), field, by)

    def tokens_per_s(self, dataset: str, window_s: float = 60.0) -> float | None:
        """Committed tokens per second over the last ``window_s`` (None: no commits in it).
        The points carry Redis time (commit.lua), so the window is read in Redis time too."""
        now = self.now()
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

    def buckets(self, dataset: str) -> list[Bucket]:
        """The in-flight buckets admission reads (start, requests, sum of their caps)."""
        return read_buckets(self.r.hgetall(self.k(dataset, keys.BUCKETS)))

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
            pipe.zcard(self.k(dataset, keys.PARKED))
            stats, pending, in_flight, dead, closed, budget, parked = pipe.execute()
        stats = {k: float(v) if "." in v else int(v) for k, v in stats.items()}
        budget = int(budget) if budget is not None else self.settings.budget_for(dataset)
        return {"dataset": dataset, "budget": budget,
                "tokens": int(stats.get("tokens", 0)), "stats": stats,
                "pending": pending, "in_flight": in_flight, "dead": dead, "closed": closed,
                "waiting": parked}


RATE_QUANTILE = 0.8


def decode_rate(speeds: Sequence[str], stats: Mapping[str, str]) -> float | None:
    """Tokens per second of one request now: a high quantile of the recent responses'
    speeds. A server decodes faster as its batch drains, and a short response carries more
    of the prefill: the fast end of recent responses is the nearest to the speed of the
    requests in flight, and over-estimating their progress only reserves more."""
    per_response = []
    for pair in speeds:
        tokens, seconds = (float(x) for x in pair.split())
        if seconds > 0 and tokens > 0:
            per_response.append(tokens / seconds)
    if per_response:
        per_response.sort()
        return per_response[min(len(per_response) - 1, int(RATE_QUANTILE * len(per_response)))]
    decoded, decode_s = float(stats.get("decoded", 0)), float(stats.get("decode_s", 0))
    return decoded / decode_s if decode_s > 0 else None
