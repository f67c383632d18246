"""Where each extraction shard stands, in Redis: done, running (leased), queued or dead.

Shared by the `gpu` task (datagen/extraction/runner.py) and ``datagen extract``; imports
neither torch nor worker code. A shard is done *for one content*: its entry carries the sha256
of the shard file, so a shard rewritten by a later ``datagen prepare`` is not taken as done.

Every shard sent to the `gpu` queue has a ``running`` entry from the moment it is sent
(``sent``: a message names it and no run has taken it since), so the ledger, not kombu, knows
about a message once it leaves Redis: the gpu queue is consumed without acks (datagen/broker.py),
and a worker that dies between taking a message and starting its shard leaves an entry that is
``sent`` but neither queued nor leased; the reaper sends it again once that has lasted a lease.

A gpu task holds a lease on its shard while it runs (SET NX with a TTL, refreshed by a thread),
so a duplicate message of a running shard is dropped instead of writing the same files twice,
and the entry records its owner until the shard is done or dead. A worker (or a rank of a
replica) killed mid-shard leaves the entry with its owner and a lease that expires: the reaper
of any live gpu worker then re-enqueues the shard at the retry priority, ahead of fresh shards,
within a second of the expiry (no Celery countdown, no visibility timeout is involved). A
failed run parks its entry with a ``not_before`` time instead of an ETA message. The samples a
dead run finished stay done on disk (the manifest) and are not redone.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis

from datagen import keys

log = logging.getLogger(__name__)

# The extraction phase's keys live with every other key in datagen/keys.py.
PREFIX = keys.EXTRACT_PREFIX
DONE = keys.EXTRACT_DONE
DEAD = keys.EXTRACT_DEAD
DEAD_SAMPLES = keys.EXTRACT_DEAD_SAMPLES
PROGRESS = keys.EXTRACT_PROGRESS
LEASE = keys.EXTRACT_LEASE
RUNNING = keys.EXTRACT_RUNNING

GPU_QUEUE = "gpu"


def lease_key(shard: str) -> str:
    return LEASE + shard


@dataclass(frozen=True)
class Reclaim:
    """A taken shard to send again: ``tries`` counts the dead run; ``dead_owner`` is the run
    that died holding it, None when its message was lost before any run or its retry is due."""

    shard: str
    tries: int
    dead_owner: str | None
    lost: bool  # sent, then neither queued nor leased for a lease: a taker died before its run


@dataclass(frozen=True)
class ShardState:
    path: str
    samples: int
    tokens: int
    sha256: str


class ExtractionLedger:
    def __init__(self, client: redis.Redis):
        self.r = client

    # -- done / dead -----------------------------------------------------------------------

    def done(self) -> dict[str, dict[str, Any]]:
        return {k: json.loads(v) for k, v in self.r.hgetall(DONE).items()}

    def dead(self) -> dict[str, dict[str, Any]]:
        return {k: json.loads(v) for k, v in self.r.hgetall(DEAD).items()}

    def is_done(self, shard: str, sha256: str) -> bool:
        raw = self.r.hget(DONE, shard)
        return raw is not None and json.loads(raw).get("sha256") == sha256

    def mark_done(self, shard: str, entry: dict[str, Any], failed: int) -> None:
        with self.r.pipeline() as pipe:
            pipe.hset(DONE, shard, json.dumps(entry))
            pipe.hdel(RUNNING, shard)
            pipe.hset(DEAD_SAMPLES, shard, failed)
            pipe.hdel(DEAD, shard)
            pipe.hdel(PROGRESS, shard)
            pipe.execute()

    def mark_dead(self, shard: str, sha256: str, reason: str, worker: str) -> None:
        entry = {"sha256": sha256, "reason": reason[:1000], "time": time.time(), "worker": worker}
        with self.r.pipeline() as pipe:
            pipe.hset(DEAD, shard, json.dumps(entry))
            pipe.hdel(PROGRESS, shard)
            pipe.hdel(RUNNING, shard)
            pipe.execute()

    def reopen(self, shards: Iterable[str]) -> None:
        """Done shards to run again (a stream's lost samples: their states to recompute)."""
        names = list(shards)
        if names:
            self.r.hdel(DONE, *names)

    def forget_dead(self, shards: Iterable[str]) -> None:
        names = list(shards)
        if names:
            self.r.hdel(DEAD, *names)

    def dead_samples(self) -> int:
        return sum(int(v) for v in self.r.hvals(DEAD_SAMPLES))

    # -- running ---------------------------------------------------------------------------

    def progress(self, shard: str, handled: int, total: int, worker: str) -> None:
        self.r.hset(PROGRESS, shard, json.dumps({"handled": handled, "total": total,
                                                 "worker": worker, "time": time.time()}))

    def running(self) -> dict[str, dict[str, Any]]:
        return {k: json.loads(v) for k, v in self.r.hgetall(PROGRESS).items()}

    def leased(self, shards: Iterable[str]) -> set[str]:
        names = list(shards)
        if not names:
            return set()
        values = self.r.mget([lease_key(s) for s in names])
        return {s for s, v in zip(names, values, strict=True) if v is not None}

    @contextmanager
    def lease(self, shard: str, owner: str, ttl_s: float) -> Iterator[bool]:
        """Hold the shard while the block runs; yields False (holding nothing) when another
        live worker has it."""
        ttl_ms = max(int(ttl_s * 1000), 1000)
        if not self.r.set(lease_key(shard), owner, nx=True, px=ttl_ms):
            yield False
            return
        self._set_entry(shard, owner=owner, since=time.time(), not_before=0.0, sent=False)
        stop = threading.Event()
        keeper = threading.Thread(target=self._keep, args=(shard, owner, ttl_ms, stop),
                                  name="extract-lease", daemon=True)
        keeper.start()
        try:
            yield True
        except BaseException:
            self._set_entry(shard, owner=None)  # a failure, not a death: the caller decides
            raise
        finally:
            stop.set()
            keeper.join()
            if self.r.get(lease_key(shard)) == owner:
                self.r.delete(lease_key(shard))

    def _keep(self, shard: str, owner: str, ttl_ms: int, stop: threading.Event) -> None:
        while not stop.wait(ttl_ms / 3000):
            try:
                if self.r.get(lease_key(shard)) == owner:
                    self.r.pexpire(lease_key(shard), ttl_ms)
            except redis.RedisError as exc:  # the run goes on; the lease may lapse
                log.warning("cannot refresh the lease of %s: %s", shard, exc)

    # -- taken shards: retries and reclaims ----------------------------------------------

    def entry(self, shard: str) -> dict[str, Any]:
        raw = self.r.hget(RUNNING, shard)
        return json.loads(raw) if raw else {"tries": 0}

    def _set_entry(self, shard: str, **fields: Any) -> dict[str, Any]:
        entry = {**self.entry(shard), **fields}
        self.r.hset(RUNNING, shard, json.dumps(entry))
        return entry

    def retry_later(self, shard: str, delay_s: float) -> int:
        """A failed run: one more try, re-enqueued by the reaper after ``delay_s``; returns
        the tries so far. The run consumed its message: the entry is not ``sent`` any more."""
        entry = self.entry(shard)
        tries = int(entry.get("tries", 0)) + 1
        self._set_entry(shard, tries=tries, owner=None, not_before=time.time() + delay_s,
                        sent=False)
        return tries

    def sent(self, shards: Iterable[str]) -> None:
        """Shards about to be sent to the queue (before the message, so a message is never
        without its entry); entries of earlier runs keep their tries."""
        names = list(shards)
        if not names:
            return
        now = time.time()
        olds = self.r.hmget(RUNNING, names)
        entries = {s: json.dumps({**(json.loads(o) if o else {"tries": 0}), "owner": None,
                                  "not_before": 0.0, "sent": True, "sent_at": now})
                   for s, o in zip(names, olds, strict=True)}
        self.r.hset(RUNNING, mapping=entries)

    def requeued(self, shard: str, tries: int, by: str) -> None:
        now = time.time()
        self._set_entry(shard, tries=tries, owner=None, not_before=0.0, sent=True, sent_at=now,
                        requeued_at=now, requeued_by=by)

    def settle(self, shard: str) -> None:
        """A message for a shard already done: nothing is left to run."""
        self.r.hdel(RUNNING, shard)

    def reclaimable(self, task_name: str, grace_s: float) -> list[Reclaim]:
        """Taken shards that nobody runs and no message in the queue names: their run died
        (owner, lease expired), their retry delay is over, or they were sent more than
        ``grace_s`` ago and their message was taken by a worker that died before the run.

        The queue is read before the leases: a worker takes the lease a few milliseconds
        after it takes the message, so read the other way round a shard just taken could look
        like neither."""
        entries = {k: json.loads(v) for k, v in self.r.hgetall(RUNNING).items()}
        now = time.time()
        due = {shard: e for shard, e in entries.items()
               if float(e.get("not_before", 0)) <= now
               and (e.get("owner") or not e.get("sent")
                    or now - float(e.get("sent_at", 0)) > grace_s)}
        if due:
            queued = self.queued(task_name)
            due = {s: e for s, e in due.items() if s not in queued}
        if due:
            leased = self.leased(due)
            due = {s: e for s, e in due.items() if s not in leased}
        out = []
        for shard, e in due.items():
            owner = e.get("owner")
            out.append(Reclaim(shard, int(e.get("tries", 0)) + (1 if owner else 0), owner,
                               lost=bool(e.get("sent")) and not owner))
        return out

    # -- queue -----------------------------------------------------------------------------

    def queue_length(self) -> int:
        """Messages waiting in the gpu queue, over its priority lists."""
        return sum(int(self.r.llen(name)) for name in keys.queue_lists(GPU_QUEUE))

    def queued(self, task_name: str) -> set[str]:
        """Shards named by messages waiting in the gpu queue, at any priority. A message a
        worker took is gone from Redis (no acks on the gpu queue, no `unacked` copy)."""
        raws: list[Any] = []
        for name in keys.queue_lists(GPU_QUEUE):
            raws += self.r.lrange(name, 0, -1)
        out: set[str] = set()
        for raw in raws:
            shard = _shard_of(raw, task_name)
            if shard is not None:
                out.add(shard)
        return out


def _shard_of(raw: Any, task_name: str) -> str | None:
    """The shard of one kombu message (JSON text or dict), None for anything else."""
    try:
        msg = json.loads(raw) if isinstance(raw, str) else raw
        if msg["headers"].get("task") != task_name:
            return None
        body = msg["body"]
        if msg.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        _args, kwargs, _embed = json.loads(body)
        return str(kwargs["shard"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def done_version(sha256: str, settings: Any) -> str:
    """What a shard's done entry must match: its content, and for a stream its epoch (each
    epoch streams every shard again)."""
    if settings.states_to == "stream":
        return f"{sha256}@e{settings.stream_epoch}"
    return sha256


def shard_states(manifest: dict[str, Any], settings: Any = None) -> list[ShardState]:
    return [ShardState(s["path"], int(s["samples"]), int(s["tokens"]),
                       s["sha256"] if settings is None else done_version(s["sha256"], settings))
            for s in manifest["shards"]]


def split_shards(shards: list[ShardState], xl: ExtractionLedger
                 ) -> tuple[list[ShardState], list[ShardState], list[ShardState]]:
    """(done, dead, todo) for the current content of each shard."""
    done, dead = xl.done(), xl.dead()
    out: tuple[list[ShardState], list[ShardState], list[ShardState]] = ([], [], [])
    for s in shards:
        if done.get(s.path, {}).get("sha256") == s.sha256:
            out[0].append(s)
        elif dead.get(s.path, {}).get("sha256") in (s.sha256, ""):  # "": file unreadable
            out[1].append(s)
        else:
            out[2].append(s)
    return out


def nowhere(todo: list[ShardState], xl: ExtractionLedger, task_name: str) -> list[ShardState]:
    """Shards to do that are neither running nor waiting in the queue, nor sent or taken
    before (those have an entry, and are the reaper's: runner.reap)."""
    leased = xl.leased(s.path for s in todo)
    queued = xl.queued(task_name)
    taken = set(xl.r.hkeys(RUNNING))
    return [s for s in todo if s.path not in leased | queued | taken]
