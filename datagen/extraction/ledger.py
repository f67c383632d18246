"""Where each extraction shard stands, in Redis: done, running (leased), queued or dead.

Shared by the `gpu` task (datagen/extraction/runner.py) and ``datagen extract``; imports
neither torch nor worker code. A shard is done *for one content*: its entry carries the sha256
of the shard file, so a shard rewritten by a later ``datagen prepare`` is not taken as done.

A gpu task holds a lease on its shard while it runs (SET NX with a TTL, refreshed by a thread),
so a duplicate message of a running shard is dropped instead of writing the same files twice;
a worker killed mid-shard leaves a lease that expires, after which ``datagen extract`` finds
the shard nowhere (not done, not leased, not queued) and enqueues it again. The samples the
dead worker finished stay done on disk (the engine's manifest) and are not redone.
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

GPU_QUEUE = "gpu"
UNACKED = "unacked"  # kombu's HASH of delivered, unacknowledged messages (ETA retries wait here)


def lease_key(shard: str) -> str:
    return LEASE + shard


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
            pipe.hset(DEAD_SAMPLES, shard, failed)
            pipe.hdel(DEAD, shard)
            pipe.hdel(PROGRESS, shard)
            pipe.execute()

    def mark_dead(self, shard: str, sha256: str, reason: str, worker: str) -> None:
        entry = {"sha256": sha256, "reason": reason[:1000], "time": time.time(), "worker": worker}
        with self.r.pipeline() as pipe:
            pipe.hset(DEAD, shard, json.dumps(entry))
            pipe.hdel(PROGRESS, shard)
            pipe.execute()

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
        stop = threading.Event()
        keeper = threading.Thread(target=self._keep, args=(shard, owner, ttl_ms, stop),
                                  name="extract-lease", daemon=True)
        keeper.start()
        try:
            yield True
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

    # -- queue -----------------------------------------------------------------------------

    def queued(self, task_name: str) -> set[str]:
        """Shards named by messages waiting in the gpu queue or held unacked (ETA retries)."""
        raws = list(self.r.lrange(GPU_QUEUE, 0, -1))
        raws += [_unwrap_unacked(v) for v in self.r.hvals(UNACKED)]
        out: set[str] = set()
        for raw in raws:
            shard = _shard_of(raw, task_name)
            if shard is not None:
                out.add(shard)
        return out


def _unwrap_unacked(raw: str) -> Any:
    try:
        return json.loads(raw)[0]  # [message, exchange, routing_key]
    except (ValueError, IndexError, TypeError, KeyError):
        return None


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


def shard_states(manifest: dict[str, Any]) -> list[ShardState]:
    return [ShardState(s["path"], int(s["samples"]), int(s["tokens"]), s["sha256"])
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
    """Shards to do that are neither running nor waiting in the queue."""
    leased = xl.leased(s.path for s in todo)
    queued = xl.queued(task_name)
    return [s for s in todo if s.path not in leased and s.path not in queued]
