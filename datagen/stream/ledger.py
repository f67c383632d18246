"""What one epoch of the stream published and what the SpecForge consumer acknowledged.

Per epoch, in Redis (keys.stream_*): a sample's room is *reserved* (reserve.lua) before it is
put, so the resident bytes (reserved - acknowledged) never pass the bound, across every gpu
process of the run; it is *published* once its put returned, which is what the resume skips.
A process killed between its put and ``published`` leaves the room reserved and the id
unpublished: the re-run puts the same id again (the consumer's SQLite dedups it by id). Acks
come from the consumer's own SQLite (``Publisher.acked()``) and free their room once
(ack.lua). No torch here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import redis

from datagen import keys
from datagen.errors import BadInput, StreamUnavailable

RATE_WINDOW_S = 60.0  # the trainer's rate: acks over the last minute


def _script(name: str) -> str:
    return resources.files("datagen.stream").joinpath("lua", name).read_text(encoding="utf-8")


def stream_dir(settings: Any) -> Path:
    """The plane's folder (plane.json, the consumer's channel): stream_dir, else under the
    run's output folder."""
    return Path(settings.stream_dir or Path(settings.output_dir) / "stream")


def in_epoch(sample_id: str, epoch: int) -> bool:
    return sample_id.endswith(f"@e{epoch}")


@dataclass(frozen=True)
class StreamCounts:
    epoch: int
    published: int
    acked: int
    resident_bytes: int
    acks_per_s: float  # over the last RATE_WINDOW_S


class StreamLedger:
    def __init__(self, client: redis.Redis, epoch: int):
        self.r = client
        self.epoch = epoch
        self.reserved_key = keys.stream_reserved(epoch)
        self.published_key = keys.stream_published(epoch)
        self.acked_key = keys.stream_acked(epoch)
        self.totals_key = keys.stream_totals(epoch)
        self._reserve = client.register_script(_script("reserve.lua"))
        self._ack = client.register_script(_script("ack.lua"))

    def reserve(self, sample_id: str, nbytes: int, bound: int) -> bool:
        """Room for this sample under ``bound`` taken (or already its own), else False."""
        self.r.sadd(keys.STREAM_EPOCHS, self.epoch)
        return bool(self._reserve(keys=[self.reserved_key, self.totals_key],
                                  args=[sample_id, nbytes, bound]))

    def published(self, sample_id: str, nbytes: int) -> None:
        self.r.hset(self.published_key, sample_id, nbytes)

    def forget(self, sample_ids: Iterable[str]) -> None:
        """No longer published (their bytes were lost with a segment holder): the extraction's
        re-run recomputes them; their room stays reserved (reserve.lua keeps a reserved id's)."""
        ids = list(sample_ids)
        if ids:
            self.r.hdel(self.published_key, *ids)

    def is_published(self, sample_id: str) -> bool:
        return bool(self.r.hexists(self.published_key, sample_id))

    def published_ids(self) -> set[str]:
        return {_text(x) for x in self.r.hkeys(self.published_key)}

    def acked(self, sample_ids: Iterable[str], now: float | None = None) -> int:
        """Record acknowledged ids (any epoch's: only this epoch's reserved ones count)."""
        mine = [s for s in sample_ids if in_epoch(s, self.epoch)]
        if not mine:
            return 0
        stamp = time.time() if now is None else now
        return int(self._ack(keys=[self.reserved_key, self.acked_key, self.totals_key],
                             args=[stamp, *mine]))

    def acked_ids(self) -> set[str]:
        return {_text(x) for x in self.r.hkeys(self.acked_key)}

    def resident_bytes(self) -> int:
        totals = self.r.hmget(self.totals_key, ["reserved_bytes", "acked_bytes"])
        return int(totals[0] or 0) - int(totals[1] or 0)

    def refreshed(self, consumer: tuple[set[str], bool] | None) -> StreamCounts:
        """The counts once the acks in ``consumer`` (consumer_state's) are recorded: the gpu
        workers record them only while a put waits for room, so after an epoch's last put
        the trainer's last acks are not in the ledger yet."""
        if consumer is not None:
            self.acked(consumer[0])
        return self.counts()

    def counts(self, now: float | None = None) -> StreamCounts:
        now = time.time() if now is None else now
        recent = sum(1 for t in self.r.hvals(self.acked_key) if float(t) >= now - RATE_WINDOW_S)
        return StreamCounts(self.epoch, int(self.r.hlen(self.published_key)),
                            int(self.r.hlen(self.acked_key)), self.resident_bytes(),
                            recent / RATE_WINDOW_S)


def ask_epoch(client: redis.Redis, epoch: int) -> None:
    """`datagen extract` says which epoch it streams (the gpu workers check theirs)."""
    client.set(keys.STREAM_ASKED_EPOCH, epoch)


def require_epoch(client: redis.Redis, epoch: int) -> None:
    """A gpu worker whose stream_epoch is not the one `datagen extract` asked for would mark
    the shards done for the wrong epoch: refuse the shard (retried, then dead-lettered with
    this reason) until it runs with the same value."""
    asked = client.get(keys.STREAM_ASKED_EPOCH)
    if asked is not None and int(asked) != epoch:
        raise StreamUnavailable(f"this gpu worker streams epoch {epoch} (stream_epoch) but "
                                f"`datagen extract` asked for epoch {int(asked)}: restart the "
                                f"gpu workers with stream_epoch = {int(asked)}")


def epochs(client: redis.Redis) -> list[int]:
    return sorted(int(e) for e in client.smembers(keys.STREAM_EPOCHS))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def describe(counts: StreamCounts, bound_bytes: int, trainer_ended: bool = False) -> str:
    """One `datagen status` line of an epoch streamed into SpecForge."""
    rate = ("trainer ended" if trainer_ended else
            f"trainer {counts.acks_per_s:.2f} samples/s over the last {RATE_WINDOW_S:.0f} s")
    return (f"stream epoch {counts.epoch}: {counts.published:,} published, {counts.acked:,} "
            f"acknowledged, {counts.resident_bytes / 2**20:,.1f} MiB resident of "
            f"{bound_bytes / 2**20:,.1f} MiB (stream_resident_bytes); {rate}")


def consumer_state(folder: Path) -> tuple[set[str], bool] | None:
    """The ids the consumer acknowledged, from its own SQLite (SpecForge's durable marker),
    and whether it has ended (``.consumer_done``), read from the plane's folder; None where
    this host does not see it (no plane.json, no consumer.sqlite yet) or has no SpecForge
    (`make install` brings its readers)."""
    from datagen.stream.plane import PlaneInfo

    try:
        from specforge.runtime.control_plane.metadata_store import SQLiteMetadataStore

        plane = PlaneInfo.read(folder)
    except (ImportError, BadInput, OSError):
        return None
    if not plane.db_path.exists():
        return None
    acked = set(SQLiteMetadataStore(str(plane.db_path)).durable_marker()["acked"])
    return acked, Path(plane.channel_path + ".consumer_done").exists()


def status_lines(client: redis.Redis, bound_bytes: int, folder: Path | None = None
                 ) -> list[str]:
    """A line per epoch that streamed anything, oldest first. With the plane's ``folder``
    the consumer's acks are recorded first (the gpu workers record them only while a put
    waits for room, so after an epoch's last put the trainer's last acks were not in the
    ledger), and an ended consumer is said so instead of a rate."""
    found = epochs(client)
    consumer = consumer_state(folder) if folder is not None and found else None
    ended = consumer is not None and consumer[1]
    return [describe(StreamLedger(client, e).refreshed(consumer), bound_bytes, ended)
            for e in found]
