"""A stand-in for the plane's Publisher and for SpecForge's consumer, built from SpecForge
0.2.0's REAL parts: LocalFeatureStore (its in-memory feature store; Mooncake in the real
plane), StreamingRefChannel (refs.jsonl) and SQLiteMetadataStore (consumer.sqlite: commit by
sample id dedups, record_train_ack is what the trainer acknowledged).

A child process (a gpu worker killed in a test) cannot share the store's memory: with
``dump_dir`` the store also writes each sample under it (the store's own capture tap) and the
consumer reads it from there; that folder stands in for the segment holder's memory.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
from specforge.runtime.control_plane.metadata_store import SQLiteMetadataStore
from specforge.runtime.data_plane.feature_store import LocalFeatureStore
from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel

STORE_ID = "consumer"
HANG_ENV = "FAKE_PUBLISHER_HANG_AFTER"  # a child's publisher stops for good after N puts


def stream_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The file build's names and shapes renamed as SpecForge's stream wants them (§12)."""
    ids = tensors["input_ids"].unsqueeze(0)
    return {"input_ids": ids, "loss_mask": tensors["loss_mask"].unsqueeze(0),
            "attention_mask": torch.ones_like(ids),
            "hidden_state": tensors["aux_hidden_state"],
            "target": tensors["hidden_state"].to(torch.bfloat16)}


class FakePublisher:
    def __init__(self, root: Path, store: LocalFeatureStore | None = None,
                 dump: bool = False):
        self.root = root
        self.channel = StreamingRefChannel(str(root / "refs.jsonl"))
        self.store = store or LocalFeatureStore(
            STORE_ID, dump_dir=str(root / "segment") if dump else None)
        self.put_bytes: dict[str, int] = {}
        self.peak_resident = 0  # bytes put and not acknowledged, at the end of each put
        self.waiting = threading.Event()  # the sink asked for acks: it waits for room
        self.puts = 0
        self._hang_after = int(os.environ.get(HANG_ENV, "0"))

    def put(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> int:
        if self.store.dump_dir:  # ids hold "/": the dump's sub-folder first
            (Path(self.store.dump_dir) / sample_id).parent.mkdir(parents=True, exist_ok=True)
        ref = self.store.put(stream_tensors(tensors), sample_id=sample_id, metadata={
            "strategy": "eagle3", "schema_version": 1, "generation": 0,
            "target_repr": "hidden_state", "num_tokens": int(tensors["input_ids"].numel())})
        self.channel.publish(ref)
        self.puts += 1
        if self.puts == self._hang_after:  # killed here: put and published, ledger not told
            (self.root / "hanging").write_text(sample_id)
            while True:
                time.sleep(1)
        self.put_bytes[sample_id] = ref.estimated_bytes
        acked = self.acked()
        resident = sum(b for sid, b in self.put_bytes.items() if sid not in acked)
        self.peak_resident = max(self.peak_resident, resident)
        return ref.estimated_bytes

    def acked(self) -> set[str]:
        self.waiting.set()
        meta = SQLiteMetadataStore(str(self.root / "consumer.sqlite"))
        try:
            return set(meta.durable_marker()["acked"])
        finally:
            meta.close()

    def consumer_done(self) -> bool:
        return self.channel.consumer_stopped()


class StandInConsumer:
    """Reads refs with SpecForge's channel reader, commits them (dedup by id), fetches the
    tensors and acknowledges them: at once (``auto_ack``) or only when the test says."""

    def __init__(self, root: Path, store: LocalFeatureStore | None = None,
                 auto_ack: bool = True):
        self.root = root
        self.store = store
        self.auto_ack = auto_ack
        self.channel = StreamingRefChannel(str(root / "refs.jsonl"))
        self.meta = SQLiteMetadataStore(str(root / "consumer.sqlite"))
        self.received: list[tuple[str, dict[str, torch.Tensor]]] = []  # in trained order
        self.refs_seen = 0
        self._unacked: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StandInConsumer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.meta.close()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            refs = self.channel.poll()
            self.refs_seen += len(refs)
            fresh = [r for r, new in zip(refs, self.meta.commit_samples(refs), strict=True)
                     if new]
            for ref in fresh:
                with self._lock:
                    self.received.append((ref.sample_id, self._tensors(ref)))
                    self._unacked.append(ref.sample_id)
            if self.auto_ack:
                self.ack()

    def _tensors(self, ref) -> dict[str, torch.Tensor]:
        if self.store is not None:
            tensors, handle = self.store.get(ref)
            out = {k: v.clone() for k, v in tensors.items()}
            self.store.release(handle)
            return out
        return torch.load(self.root / "segment" / f"{ref.sample_id}.ckpt", weights_only=True)

    def ack(self, n: int | None = None) -> int:
        """Acknowledge the next ``n`` received samples (all: None), as a trainer step does."""
        with self._lock:
            ids = self._unacked[:n] if n is not None else list(self._unacked)
            del self._unacked[:len(ids)]
        if ids:
            self.meta.record_train_ack(ids, global_step=None, optimizer_durable=True)
        return len(ids)

    def acked(self) -> set[str]:
        return set(self.meta.durable_marker()["acked"])
