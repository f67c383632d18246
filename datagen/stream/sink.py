"""Where the extractor hands a sample's states when states_to = "stream": into the SpecForge
consumer's feature store through a ``Publisher`` (datagen/stream/publisher.py), never to disk.

Exactly once per epoch: a sample's id is ``<dataset>/<id>@e<epoch>``; the ledger skips what
was published; a put whose ledger write a crash cut short is put again under the same id and
the consumer's SQLite (commit_sample by id) trains it once. Bounded, never dropped: before a
put the sink waits while the epoch's resident bytes (reserved - acknowledged) plus this
sample's would pass ``bound_bytes``; the acks are read from the consumer's own ledger. The
wait runs inside the shard's run, whose lease thread (extraction/ledger.py) keeps the shard
owned however long the trainer takes. The sink serialises its puts: the room check and the
put are one step per process, and reserve.lua makes them one across processes.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from datagen.errors import ConsumerStopped, StreamUnavailable
from datagen.stream.ledger import StreamLedger

if TYPE_CHECKING:
    import torch

    from datagen.stream.recovery import Recompute


log = logging.getLogger(__name__)

POLL_S = 0.2  # how often a full store re-reads the consumer's acks


class Publisher(Protocol):
    """The seam to SpecForge's data plane (datagen/stream/publisher.py implements it)."""

    def put(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> int: ...
    def acked(self) -> set[str]: ...
    def lost_ids(self, epoch: int) -> list[str]: ...
    def consumer_done(self) -> bool: ...


def sample_id(dataset: str, record_id: str, epoch: int) -> str:
    """Stable per sample and epoch: a re-publication is deduped, epoch 2 is a new id."""
    return f"{dataset}/{record_id}@e{epoch}"


def stream_bytes(tensors: dict[str, torch.Tensor]) -> int:
    """What the sample holds in the store, from the file build's tensors: input_ids,
    loss_mask and an attention_mask as int64, aux in its dtype, the final states in bf16."""
    positions = tensors["input_ids"].numel()
    aux = tensors["aux_hidden_state"]
    return 3 * 8 * positions + aux.numel() * aux.element_size() \
        + 2 * tensors["hidden_state"].numel()


class StreamSink:
    def __init__(self, publisher: Publisher, ledger: StreamLedger, bound_bytes: int,
                 poll_s: float = POLL_S):
        self.publisher = publisher
        self.ledger = ledger
        self.bound_bytes = bound_bytes
        self.poll_s = poll_s
        self.epoch = ledger.epoch
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def sample_id(self, dataset: str, record_id: str) -> str:
        return sample_id(dataset, record_id, self.epoch)

    def done(self, sid: str) -> bool:
        return self.ledger.is_published(sid)

    def put(self, sid: str, tensors: dict[str, torch.Tensor]) -> int:
        """Wait for room, put, record: the bytes the sample holds in the store."""
        need = stream_bytes(tensors)
        with self._lock:
            self._wait_for_room(sid, need)
            try:
                size = self.publisher.put(sid, tensors)
            except Exception as exc:  # the plane's fault, not the sample's: retry the shard
                raise StreamUnavailable(f"put of {sid} into the feature store failed: "
                                        f"{type(exc).__name__}: {exc}") from exc
            if size > need:
                log.warning("sample %s holds %d bytes in the store, %d were reserved", sid,
                            size, need)
            self.ledger.published(sid, size)
        return size

    def recover(self, recompute: Recompute) -> list[str]:
        """After a segment holder was lost: this epoch's published, unacknowledged samples
        whose bytes are gone, recomputed and put again, which puts them back under their refs
        (recovery.py). The ledger is unchanged: each stays one published sample, its room
        still reserved until the consumer acknowledges it."""
        with self._lock:
            lost = self.publisher.lost_ids(self.epoch)
            for sid in lost:
                self.publisher.put(sid, recompute(sid))
        return lost

    def forget_lost(self) -> list[str]:
        """After a segment holder was lost: this epoch's lost samples leave the ledger's
        published list, so the extraction's re-run of their shards recomputes their states
        from their records (a prefill) and its put restores them under their refs."""
        with self._lock:
            lost = self.publisher.lost_ids(self.epoch)
            self.ledger.forget(lost)
        return lost

    def refresh_acks(self) -> int:
        return self.ledger.acked(self.publisher.acked())

    def _wait_for_room(self, sid: str, need: int) -> None:
        waited = False
        while not self.ledger.reserve(sid, need, self.bound_bytes):
            if not waited:
                log.info("stream full: %d resident + %d > %d bytes; waiting for the trainer's "
                         "acks", self.ledger.resident_bytes(), need, self.bound_bytes)
                waited = True
            if self.refresh_acks():
                continue
            if self.publisher.consumer_done():
                raise ConsumerStopped(f"the SpecForge consumer stopped with {sid} waiting for "
                                      "room: nothing more can be acknowledged")
            if self._stop.wait(self.poll_s):
                raise ConsumerStopped("the stream sink was closed while waiting for room")

    def close(self) -> None:
        self._stop.set()


def open_sink(stream_dir: str | Path, redis_url: str, epoch: int, bound_bytes: int) -> StreamSink:
    """The run's sink: the plane's Publisher (its plane.json under ``stream_dir``) and the
    epoch's ledger on ``redis_url``."""
    from datagen.generation.ledger import connect
    from datagen.stream.plane import PlaneInfo  # the plane's (issue 45): loaded when streaming
    from datagen.stream.publisher import Publisher as PlanePublisher

    plane: Any = PlaneInfo.read(stream_dir)
    publisher = PlanePublisher(plane, plane.channel_path)
    publisher.wait_ready()
    return StreamSink(publisher, StreamLedger(connect(redis_url), epoch), bound_bytes)
