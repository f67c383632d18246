"""Puts one sample's states into the consumer's Mooncake feature store and publishes its ref on
the consumer's StreamingRefChannel (``refs.jsonl``), with SpecForge 0.2.0's own classes.

What the stock ``specforge train --role consumer`` takes (read from its
source and run): refs with ``strategy = "eagle3"``, ``schema_version = 1``,
``metadata.generation`` (the store adds it), ``metadata.target_repr = "hidden_state"``; the
stream's names differ from the ``.ckpt``'s: ``hidden_state`` is the file's
``aux_hidden_state`` [1,T,3H], ``target`` the file's ``hidden_state`` [1,T,H], both bf16
(SpecForge trains in bf16); ``input_ids``, ``loss_mask``, ``attention_mask`` [1,T] int64.

Idempotent per sample id: a publisher remembers every id on the channel (it reads the channel
when it opens, so a publisher that replaces a dead one knows what that one published) and a
second put of one publishes nothing and stores nothing — unless a SIGKILLed segment holder
took the sample's bytes before the consumer acknowledged it: then the put restores them under
the published ref's keys (datagen/stream/recovery.py). Two publishers racing on one id both
publish; the consumer's SQLite ledger commits the first and drops the second
(``commit_samples`` dedups by sample id: tests/datagen/stream/test_plane_publisher.py).

The witness of what was streamed: each put appends one line to ``<stream_dir>/published.jsonl``
(sample id, epoch, each stream tensor's sha256, shape and dtype, the bytes the store holds), no
states, so what the trainer took can be checked against the records or a file build. The line
follows the ref: a publisher killed between the two leaves a ref with no line.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from datagen.errors import BadInput, ConsumerFailed
from datagen.stream import recovery
from datagen.stream.plane import PlaneInfo

TRAIN_DTYPE = torch.bfloat16
SCHEMA_VERSION = 1
STRATEGY = "eagle3"
WITNESS_NAME = "published.jsonl"


def stream_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file build's tensors (files.sample_tensors) under the stream's names and shapes."""
    missing = {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"} - set(tensors)
    if missing:
        raise BadInput(f"a sample to stream lacks {sorted(missing)} (has {sorted(tensors)})")
    ids = tensors["input_ids"].to(torch.int64).reshape(1, -1)
    n = ids.shape[1]
    aux, final = tensors["aux_hidden_state"], tensors["hidden_state"]
    if aux.shape[:2] != (1, n) or final.shape[:2] != (1, n):
        raise BadInput(f"states of {tuple(aux.shape)} / {tuple(final.shape)} for {n} tokens: "
                       "expected [1, T, 3H] and [1, T, H]")
    return {"input_ids": ids,
            "loss_mask": tensors["loss_mask"].to(torch.int64).reshape(1, n),
            "attention_mask": torch.ones(1, n, dtype=torch.int64),
            "hidden_state": aux.to(TRAIN_DTYPE),
            "target": final.to(TRAIN_DTYPE)}


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in memory order (any dtype, bf16 included)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes()).hexdigest()


def epoch_of(sample_id: str) -> int | None:
    """The epoch of a stream sample id (``<dataset>/<id>@e<epoch>``, sink.sample_id)."""
    _, sep, tail = sample_id.rpartition("@e")
    return int(tail) if sep and tail.isdigit() else None


def witness_line(sample_id: str, streamed: dict[str, torch.Tensor], nbytes: int) -> str:
    """One published.jsonl line: what the trainer is handed for ``sample_id``, no states."""
    return json.dumps({"sample_id": sample_id, "epoch": epoch_of(sample_id), "bytes": nbytes,
                       "tensors": {name: {"sha256": tensor_digest(t), "shape": list(t.shape),
                                          "dtype": str(t.dtype).removeprefix("torch.")}
                                   for name, t in sorted(streamed.items())}},
                      separators=(",", ":")) + "\n"


def read_witness(stream_dir: str | Path) -> list[dict]:
    """Every complete line of a stream's published.jsonl (none when nothing was put)."""
    try:
        text = (Path(stream_dir) / WITNESS_NAME).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.split("\n")[:-1] if line.strip()]


def _append(path: Path, line: str) -> None:
    """One write with O_APPEND: lines of concurrent publishers never interleave."""
    fd = os.open(path, os.O_APPEND | os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, line.encode("utf-8"))
    finally:
        os.close(fd)


def channel_sample_ids(channel_path: str | Path) -> set[str]:
    """Every sample id published on a channel so far (complete lines only)."""
    try:
        text = Path(channel_path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return set()
    lines = text.split("\n")[:-1]  # the last piece is a partial line, or ""
    return {json.loads(line)["sample_id"] for line in lines if line.strip()}


def close_channel(channel_path: str | Path) -> None:
    """No more refs on this channel: the consumer finishes once it has trained on all."""
    from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel

    StreamingRefChannel(str(channel_path)).close()


class Publisher:
    """Puts one sample's states into the consumer's feature store and publishes its ref."""

    def __init__(self, plane: PlaneInfo, channel_path: str | Path | None = None):
        from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore
        from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel

        self.plane = plane
        self.channel_path = str(channel_path or plane.channel_path)
        self.channel = StreamingRefChannel(self.channel_path)
        self.store = MooncakeFeatureStore(store_id=plane.store_id,
                                          setup_kwargs=plane.setup_kwargs())
        self._published = channel_sample_ids(self.channel_path)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Until the consumer published its quantum (it reads refs from then on)."""
        deadline = time.monotonic() + timeout_s
        while self.channel.consumer_quantum() is None:
            failure = self.channel.consumer_failure()
            if failure is not None:
                raise ConsumerFailed(f"the SpecForge consumer on {self.channel_path} failed: "
                                     f"{failure}")
            if time.monotonic() > deadline:
                raise ConsumerFailed(f"no SpecForge consumer on {self.channel_path} within "
                                     f"{timeout_s:.0f}s ({self.channel_path}.consumer_quantum "
                                     "never appeared): start it with the line `datagen "
                                     "stream` printed")
            time.sleep(0.1)

    def put(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> int:
        """The bytes the sample holds in the store; 0 for an id already published, unless a
        lost segment holder took its bytes (recovery.py: put back under its ref)."""
        if sample_id in self._published:
            return recovery.restore_if_lost(self.store, self.channel_path, self.acked(),
                                            sample_id, stream_tensors(tensors))
        streamed = stream_tensors(tensors)
        ref = self.store.put(streamed, sample_id=sample_id, metadata={
            "strategy": STRATEGY, "schema_version": SCHEMA_VERSION,
            "target_repr": "hidden_state", "num_tokens": int(streamed["input_ids"].shape[1]),
            "run_id": self.plane.store_id})
        self.channel.publish(ref)
        self._published.add(sample_id)
        _append(self.plane.dir / WITNESS_NAME,
                witness_line(sample_id, streamed, int(ref.estimated_bytes)))
        return int(ref.estimated_bytes)

    def lost_ids(self, epoch: int) -> list[str]:
        """The epoch's published, unacknowledged ids whose bytes a lost holder took."""
        return [r.sample_id for r in recovery.lost_refs(self.store, self.channel_path,
                                                        self.acked(), epoch)]

    def acked(self) -> set[str]:
        """Sample ids the consumer acknowledged (its consumer.sqlite durable marker)."""
        from specforge.runtime.control_plane.metadata_store import SQLiteMetadataStore

        if not self.plane.db_path.exists():
            return set()
        return set(SQLiteMetadataStore(str(self.plane.db_path)).durable_marker()["acked"])

    def consumer_done(self) -> bool:
        return Path(self.channel_path + ".consumer_done").exists()

    def close(self) -> None:
        """No more refs this run: the consumer finishes once it has trained on all."""
        close_channel(self.channel_path)

    def fail(self, reason: str) -> None:
        self.channel.fail(reason)
