"""A SIGKILLed segment holder (issue 45), all real parts: mooncake_master and mooncake_client,
SpecForge 0.2.0's MooncakeFeatureStore, its StreamingRefChannel and its stock `specforge train
--role consumer` (with the CPU loss stand-in of datagen/stream/cpu_consumer.py), the stream's
Redis ledger. The holder takes every unacknowledged sample's bytes; the stock consumer fails on
the first such ref and, resumed from its checkpoint, requeues the same refs; the sink puts the
recomputed states back under those refs, and the consumer's consumer.sqlite shows each sample
acknowledged once, under its one id, in as many optimizer steps as samples."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_sink as ts
import torch
from conftest import wait_until
from test_stream_consumer import (  # noqa: F401
    CONSUMER_HANG_S,
    N,
    acked_rows,
    handoff_config,
    kill_group,
    samples,
    start_consumer,
    wait_consumer_up,
)

from datagen.errors import BadInput
from datagen.generation.ledger import connect
from datagen.stream import consumer as sc
from datagen.stream import recovery
from datagen.stream.ledger import StreamLedger
from datagen.stream.plane import Plane, key_count
from datagen.stream.publisher import Publisher, stream_tensors
from datagen.stream.sink import StreamSink

EPOCH = 1
IDS = [f"A1/s{i}@e{EPOCH}" for i in range(N)]
BOUND = 1 << 20


model, shard = ts.model, ts.shard  # the tiny Llama and its shard of records


def lost_refs(publisher: Publisher) -> list:
    return recovery.lost_refs(publisher.store, publisher.channel_path, publisher.acked(), EPOCH)


def test_the_lost_bytes_are_found_and_put_back_under_the_published_refs(tmp_path):
    """No consumer: both published samples are lost with the holder; a restored one reads back
    byte-equal through SpecForge's own get(), a re-put of the other restores it too."""
    tensors = samples()
    plane = Plane(tmp_path / "stream", segment_bytes=64 << 20)
    with plane as info:
        publisher = Publisher(info)
        for sid, t in zip(IDS[:2], tensors[:2], strict=True):
            assert publisher.put(sid, t) > 0
        assert publisher.lost_ids(EPOCH) == []
        assert publisher.put(IDS[0], tensors[0]) == 0  # readable: a re-put stores nothing
        plane.restart_holder()
        lost = lost_refs(publisher)
        assert [r.sample_id for r in lost] == IDS[:2]
        assert publisher.lost_ids(EPOCH + 1) == []  # another epoch's: none
        assert recovery.restore(publisher.store, lost[0], stream_tensors(tensors[0])) > 0
        got, handle = publisher.store.get(lost[0])
        publisher.store.release(handle, reason="checked")
        want = stream_tensors(tensors[0])
        assert set(got) == set(want)
        for name, t in want.items():
            assert torch.equal(got[name], t), name
        assert publisher.lost_ids(EPOCH) == IDS[1:2]
        assert publisher.put(IDS[1], tensors[1]) > 0  # the re-run's put restores it
        assert publisher.lost_ids(EPOCH) == []


def test_a_recomputation_that_differs_from_the_published_ref_is_refused(tmp_path):
    tensors = samples()
    plane = Plane(tmp_path / "stream", segment_bytes=64 << 20)
    with plane as info:
        publisher = Publisher(info)
        publisher.put(IDS[0], tensors[0])
        plane.restart_holder()
        [ref] = lost_refs(publisher)
        other = stream_tensors(tensors[1])  # another sample's length
        with pytest.raises(BadInput, match=r"A1/s0@e1 feature 'input_ids'"):
            recovery.restore(publisher.store, ref, other)
        assert lost_refs(publisher) == [ref]  # nothing was put


def wait_checkpoint(db_path: Path, output_dir: Path, store_id: str, step: int, proc) -> Path:
    """Until `step` optimizer steps are durable and -latest points at their checkpoint (as
    tests/test_stream_consumer.py's resume test waits)."""
    from specforge.runtime.control_plane.metadata_store import SQLiteMetadataStore

    db = SQLiteMetadataStore(str(db_path))
    checkpoint = output_dir / f"{store_id}-step{step}"
    latest = output_dir / f"{store_id}-latest"
    wait_until(lambda: (db.durable_marker()["global_step"] == step
                        and latest.resolve() == checkpoint.resolve())
               or proc.poll() is not None, timeout_s=CONSUMER_HANG_S,
               what=f"{step} durable optimizer steps and their checkpoint")
    assert proc.poll() is None
    return checkpoint


def test_a_sigkilled_holder_leaves_each_sample_trained_once(tmp_path, handoff_config,  # noqa: F811
                                                            redis_url):
    """Two samples trained; two more published through the sink while the holder is SIGKILLed
    (their refs reach the channel after the holder is gone, so the consumer reads none of their
    bytes first). The stock consumer fails on the lost bytes, a resume alone fails again on the
    same refs; the sink's recovery puts the recomputed states back and the resumed consumer
    trains each sample once."""
    from specforge.runtime.control_plane.metadata_store import SQLiteMetadataStore

    tensors = dict(zip(IDS, samples(), strict=True))
    plane = Plane(tmp_path / "stream", segment_bytes=256 << 20)
    with plane as info:
        body = sc.consumer_config(sc.read_handoff_config(handoff_config), info, samples=N,
                                  cpu=True, save_interval=1)
        config = sc.write_consumer_config(plane.dir, body)
        output_dir = Path(body["output_dir"])
        log = tmp_path / "consumer.log"
        proc = start_consumer(config, log)
        try:
            publisher = Publisher(info)
            wait_consumer_up(publisher, proc, log)
            ledger = StreamLedger(connect(redis_url), EPOCH)
            sink = StreamSink(publisher, ledger, BOUND)
            for sid in IDS[:2]:
                sink.put(sid, tensors[sid])
            checkpoint = wait_checkpoint(info.db_path, output_dir, info.store_id, 2, proc)

            publish = publisher.channel.publish
            held: list = []
            publisher.channel.publish = held.append  # the refs wait for the holder's death
            for sid in IDS[2:]:
                sink.put(sid, tensors[sid])
            plane.restart_holder()
            for ref in held:
                publish(ref)
            publisher.channel.publish = publish

            # what the stock consumer does: fails on the first ref whose bytes are gone
            assert proc.wait(timeout=CONSUMER_HANG_S) == 1
            failure = publisher.channel.consumer_failure()
            assert "KeyError" in failure and IDS[2] in failure, failure
            assert publisher.acked() == set(IDS[:2])
            # resumed alone, it requeues the same committed refs and fails on them again
            proc = start_consumer(config, log, f"training.resume_from={checkpoint}")
            assert proc.wait(timeout=CONSUMER_HANG_S) == 1
            assert publisher.acked() == set(IDS[:2])

            assert publisher.lost_ids(EPOCH) == IDS[2:]
            assert sink.put(IDS[2], tensors[IDS[2]]) > 0  # a re-run's put restores its bytes
            assert sink.recover(tensors.__getitem__) == IDS[3:]
            assert publisher.lost_ids(EPOCH) == []

            proc = start_consumer(config, log, f"training.resume_from={checkpoint}")
            publisher.close()
            assert proc.wait(timeout=CONSUMER_HANG_S) == 0, log.read_text()[-4000:]
        finally:
            kill_group(proc)
        assert publisher.consumer_done()
        # the witness: every sample acked once under its one id, none trained twice (a replay
        # would take a step of its own: 4 steps for 4 samples)
        assert sorted(acked_rows(info.db_path)) == IDS
        db = SQLiteMetadataStore(str(info.db_path))
        assert sorted(db.all_committed_ids()) == IDS
        marker = db.durable_marker()
        assert marker["global_step"] == N and marker["optimizer_durable"]
        sink.refresh_acks()
        counts = ledger.counts()
        assert (counts.published, counts.acked, counts.resident_bytes) == (N, N, 0)
        wait_until(lambda: key_count(info) == 0, timeout_s=60, what="the store to empty")


def read(info, ref) -> dict[str, torch.Tensor]:
    """A sample's tensors as a consumer reads them: a store of its own, by the ref (not
    released: a release would free them)."""
    from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore

    reader = MooncakeFeatureStore(store_id=info.store_id, setup_kwargs=info.setup_kwargs())
    return reader.get(ref)[0]


def streamed_shard(info, redis_url, model, tmp_path, shard):
    """The shard extracted (`hf`) into the plane through a sink: (publisher, ledger, sink)."""
    publisher = Publisher(info)
    ledger = StreamLedger(connect(redis_url), EPOCH)
    sink = StreamSink(publisher, ledger, 1 << 30)
    assert ts.streamed(model, tmp_path / "out", shard, sink).written == ts.N
    return publisher, ledger, sink


def test_the_extraction_re_run_recomputes_the_lost_samples_from_their_records(
        model, shard, tmp_path, redis_url):
    """hf extraction streams a shard; the holder is SIGKILLed; forget_lost drops the lost ids
    from the ledger's published list and the shard's re-run recomputes exactly those by
    prefill, its puts restore them under their refs, byte-equal to the first run's states."""
    plane = Plane(tmp_path / "stream", segment_bytes=64 << 20)
    with plane as info:
        publisher, ledger, sink = streamed_shard(info, redis_url, model, tmp_path, shard)
        ids = sorted(ledger.published_ids())
        refs = recovery.published_refs(info.channel_path)
        first = {ref.sample_id: read(info, ref) for ref in refs}
        plane.restart_holder()
        assert sorted(publisher.lost_ids(EPOCH)) == ids
        assert sorted(sink.forget_lost()) == ids
        assert ledger.published_ids() == set()
        again = ts.streamed(model, tmp_path / "out", shard, sink)
        assert again.written == ts.N and again.skipped_done == 0
        assert publisher.lost_ids(EPOCH) == []
        assert sorted(ledger.published_ids()) == ids
        assert recovery.published_refs(info.channel_path) == refs  # no ref published twice
        for ref in refs:
            got = read(info, ref)
            for name, t in first[ref.sample_id].items():
                assert torch.equal(got[name], t), (ref.sample_id, name)


def test_extract_reopens_exactly_the_done_shards_whose_samples_the_holder_took(
        model, shard, tmp_path, redis_url):
    """What `datagen extract` does first in a stream (reopen.reopen_lost): the lost ids leave
    the ledger's published list and the done shards holding them are run again; a shard
    whose samples all survived (here: one of other records) stays done."""
    from datagen.extraction.ledger import ExtractionLedger, ShardState
    from datagen.stream.reopen import reopen_lost

    other = tmp_path / "other.jsonl"
    other.write_text('{"idx": 99, "id": "x", "dataset": "B2", "prompt_ids": [1], '
                     '"output_ids": [2]}\n')
    shards = [ShardState(shard.name, ts.N, 0, "sha-a"), ShardState(other.name, 1, 0, "sha-b")]
    xl = ExtractionLedger(connect(redis_url))
    for s in shards:
        xl.mark_done(s.path, {"sha256": s.sha256}, 0)
    plane = Plane(tmp_path / "stream", segment_bytes=64 << 20)
    with plane as info:
        publisher, ledger, sink = streamed_shard(info, redis_url, model, tmp_path, shard)
        assert reopen_lost(sink, xl, shards, shard.parent) == ([], [])  # nothing lost yet
        ids = sorted(ledger.published_ids())

        plane.restart_holder()
        lost, reopened = reopen_lost(sink, xl, shards, shard.parent)

        assert sorted(lost) == ids and reopened == [shard.name]
        assert not xl.is_done(shard.name, "sha-a") and xl.is_done(other.name, "sha-b")
        assert ledger.published_ids() == set()
        again = ts.streamed(model, tmp_path / "out", shard, sink)
        assert again.written == ts.N and publisher.lost_ids(EPOCH) == []
