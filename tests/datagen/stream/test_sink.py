"""The stream sink (datagen/stream/sink.py, ledger.py) with the real `hf` backend on a tiny
Llama, a real Redis, and SpecForge's real feature store, ref channel and consumer SQLite
(fakes.py): every sample reaches the consumer once per epoch, equal to the file build's, with
no .ckpt file, and the resident bytes never pass the bound while the consumer lags."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from conftest import wait_until, write_jsonl
from fakes import HANG_ENV, StandInConsumer, stream_tensors

from datagen.extraction.extractor import ExtractionConfig, Extractor
from datagen.generation.ledger import connect
from datagen.stream.ledger import StreamLedger
from datagen.stream.sink import StreamSink, stream_bytes

VOCAB, HIDDEN, LAYERS = 256, 64, 6
AUX = (1, 2, 3)
N = 10
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from datagen.builders.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("m") / "llama", VOCAB,
                            hidden_size=HIDDEN, num_layers=LAYERS)


@pytest.fixture
def shard(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    recs = [{"idx": i, "id": f"s{i}", "dataset": "B1",
             "prompt_ids": torch.randint(0, VOCAB, (3 + i,), generator=g).tolist(),
             "output_ids": torch.randint(0, VOCAB, (8 + 3 * i,), generator=g).tolist()}
            for i in range(N)]
    return write_jsonl(tmp_path / "shard.jsonl", recs)


def config(model: Path, out: Path, **kw: object) -> ExtractionConfig:
    return ExtractionConfig(model_path=str(model), output_dir=str(out), aux_layer_ids=AUX,
                            dtype="float32", device="cpu", max_length=64, batch_tokens=64,
                            writer_threads=1, max_pending_writes=1, **kw)


def streamed(model: Path, out: Path, shard: Path, sink: StreamSink, epoch: int = 1):
    cfg = config(model, out, states_to="stream", epoch=epoch,
                 stream_resident_bytes=sink.bound_bytes)
    with Extractor(cfg, sink=sink) as ex:
        return ex.run_shard(shard)


def file_build(model: Path, out: Path, shard: Path) -> dict[str, dict[str, torch.Tensor]]:
    with Extractor(config(model, out)) as ex:
        assert ex.run_shard(shard).written == N
    return {f"B1/s{i}": torch.load(next(out.rglob(f"data_{i}.ckpt")), weights_only=True)
            for i in range(N)}


def sink_for(tmp_path: Path, redis_url: str, consumer: StandInConsumer, epoch: int = 1,
             bound: int = 1 << 30) -> StreamSink:
    from fakes import FakePublisher

    publisher = FakePublisher(tmp_path / "plane", store=consumer.store)
    return StreamSink(publisher, StreamLedger(connect(redis_url), epoch), bound, poll_s=0.01)


def test_every_sample_reaches_the_consumer_once_equal_to_the_file_build_without_files(
        model: Path, shard: Path, tmp_path: Path, redis_url: str) -> None:
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    # Given: the same shard built as files, and a consumer acking what it trains
    files = file_build(model, tmp_path / "files", shard)
    store = LocalFeatureStore("consumer")
    with StandInConsumer(tmp_path / "plane", store) as consumer:
        sink = sink_for(tmp_path, redis_url, consumer)

        # When: the shard is streamed
        result = streamed(model, tmp_path / "stream", shard, sink)
        wait_until(lambda: len(consumer.received) == N, 60, what="every sample received")

    # Then: each sample once, its tensors the file build's renamed, no .ckpt anywhere
    assert result.written == N and not result.failures
    ids = [sid for sid, _ in consumer.received]
    assert sorted(ids) == sorted(f"B1/s{i}@e1" for i in range(N)) and consumer.refs_seen == N
    for sid, tensors in consumer.received:
        expected = stream_tensors(files[sid.removesuffix("@e1")])
        assert set(tensors) == set(expected)
        for name, value in expected.items():
            assert tensors[name].dtype == value.dtype and torch.equal(tensors[name], value), name
    assert not list((tmp_path / "stream").rglob("*.ckpt"))
    ledger = StreamLedger(connect(redis_url), 1)
    assert ledger.published_ids() == set(ids)


def test_resident_bytes_stay_under_the_bound_while_the_consumer_lags(
        model: Path, shard: Path, tmp_path: Path, redis_url: str) -> None:
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    # Given: a bound of about three of the largest samples, and a consumer that acks only
    # when the test lets it
    big = stream_bytes({"input_ids": torch.zeros(64, dtype=torch.int64),
                        "aux_hidden_state": torch.zeros(1, 64, 3 * HIDDEN),
                        "hidden_state": torch.zeros(1, 64, HIDDEN)})
    bound = 3 * big
    store = LocalFeatureStore("consumer")
    with StandInConsumer(tmp_path / "plane", store, auto_ack=False) as consumer:
        sink = sink_for(tmp_path, redis_url, consumer, bound=bound)
        publisher = sink.publisher
        done: list = []
        run = threading.Thread(target=lambda: done.append(
            streamed(model, tmp_path / "stream", shard, sink)))

        # When: extraction runs until the store is full, then the consumer acks step by step
        run.start()
        steps = 0
        while run.is_alive():
            wait_until(lambda: publisher.waiting.is_set() or not run.is_alive(), 120,
                       what="the sink waiting for room")
            # the sink waits: nothing more is put until an ack comes
            assert publisher.puts < N or not run.is_alive()
            publisher.waiting.clear()
            steps += consumer.ack(1)
        run.join()
        consumer.ack()

    # Then: it waited (several acks were needed), dropped nothing, never passed the bound
    assert done[0].written == N and steps >= 2
    assert sorted(sid for sid, _ in consumer.received) == sorted(f"B1/s{i}@e1"
                                                                 for i in range(N))
    assert 0 < publisher.peak_resident <= bound
    assert StreamLedger(connect(redis_url), 1).resident_bytes() <= bound


def test_two_epochs_give_each_sample_once_per_epoch_in_another_order(
        model: Path, shard: Path, tmp_path: Path, redis_url: str) -> None:
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    store = LocalFeatureStore("consumer")
    with StandInConsumer(tmp_path / "plane", store) as consumer:
        # Given: epoch 1 streamed; a second run of epoch 1 puts nothing (the ledger)
        first = streamed(model, tmp_path / "s", shard, sink_for(tmp_path, redis_url, consumer))
        again = streamed(model, tmp_path / "s", shard, sink_for(tmp_path, redis_url, consumer))
        # When: epoch 2 recomputes the states from the records
        second = streamed(model, tmp_path / "s", shard,
                          sink_for(tmp_path, redis_url, consumer, epoch=2), epoch=2)
        wait_until(lambda: len(consumer.acked()) == 2 * N, 60, what="both epochs acked")

    # Then: each sample once per epoch, epoch 2 in another order with the same tensors (the
    # same ids; states recomputed in other packed rows: equal to float rounding)
    assert first.written == N and again.written == 0 and again.skipped_done == N
    assert second.written == N and consumer.refs_seen == 2 * N
    order = {e: [sid.split("@")[0] for sid, _ in consumer.received if sid.endswith(f"@e{e}")]
             for e in (1, 2)}
    assert sorted(order[1]) == sorted(order[2]) == sorted(f"B1/s{i}" for i in range(N))
    assert order[1] != order[2]
    got = dict(consumer.received)
    for i in range(N):
        one, two = got[f"B1/s{i}@e1"], got[f"B1/s{i}@e2"]
        for name in ("input_ids", "loss_mask", "attention_mask"):
            assert torch.equal(one[name], two[name])
        for name in ("hidden_state", "target"):
            torch.testing.assert_close(one[name], two[name], atol=1e-2, rtol=1e-2)


CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, {here!r})
from fakes import FakePublisher
from datagen.extraction.extractor import ExtractionConfig, Extractor
from datagen.generation.ledger import connect
from datagen.stream.ledger import StreamLedger
from datagen.stream.sink import StreamSink

cfg = ExtractionConfig(model_path={model!r}, output_dir={out!r}, aux_layer_ids=(1, 2, 3),
                       dtype="float32", device="cpu", max_length=64, batch_tokens=64,
                       writer_threads=1, max_pending_writes=1, states_to="stream")
sink = StreamSink(FakePublisher(Path({plane!r}), dump=True),
                  StreamLedger(connect({redis!r}), 1), 1 << 30, poll_s=0.01)
with Extractor(cfg, sink=sink) as ex:
    r = ex.run_shard({shard!r})
print("written", r.written, "skipped", r.skipped_done)
"""


@pytest.mark.chaos
def test_a_gpu_worker_killed_between_put_and_ledger_is_trained_once_per_sample(
        model: Path, shard: Path, tmp_path: Path, redis_url: str) -> None:
    # Given: a gpu process whose 4th put is published and then killed before its ledger write
    plane = tmp_path / "plane"
    script = CHILD.format(here=str(HERE), model=str(model), out=str(tmp_path / "s"),
                          plane=str(plane), redis=redis_url, shard=str(shard))
    env = {**os.environ, HANG_ENV: "4"}
    with StandInConsumer(plane) as consumer:
        child = subprocess.Popen([sys.executable, "-c", script], env=env)
        wait_until(lambda: (plane / "hanging").is_file(), 120, what="the 4th put")
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        hung = (plane / "hanging").read_text()

        # When: the shard runs again
        env.pop(HANG_ENV)
        rerun = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                               text=True, timeout=300)
        assert rerun.returncode == 0, rerun.stderr[-2000:]
        wait_until(lambda: len(consumer.acked()) == N, 60, what="every sample acked")
        committed = consumer.meta.committed_count()

    # Then: the killed sample was published twice, trained once; each sample acked once
    assert "written 7 skipped 3" in rerun.stdout
    refs = [line for line in (plane / "refs.jsonl").read_text().splitlines()]
    assert len(refs) == N + 1 and consumer.refs_seen == N + 1
    ids = [sid for sid, _ in consumer.received]
    assert sorted(ids) == sorted(f"B1/s{i}@e1" for i in range(N)) and hung in ids
    assert committed == N
    assert StreamLedger(connect(redis_url), 1).published_ids() == set(ids)


def test_a_failed_put_or_a_stopped_consumer_retries_the_shard_and_dead_letters_nothing(
        model: Path, shard: Path, tmp_path: Path, redis_url: str) -> None:
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    from datagen.errors import ConsumerStopped, StreamUnavailable

    store = LocalFeatureStore("consumer")
    with StandInConsumer(tmp_path / "plane", store, auto_ack=False) as consumer:
        # Given: a store that fails its 3rd put
        sink = sink_for(tmp_path, redis_url, consumer)
        put, calls = sink.publisher.put, []

        def failing(sid: str, tensors: dict) -> int:
            calls.append(sid)
            if len(calls) == 3:
                raise ConnectionError("segment holder gone")
            return put(sid, tensors)

        sink.publisher.put = failing
        # When/Then: the shard fails as a whole (retried), not the sample
        with pytest.raises(StreamUnavailable, match="segment holder gone"):
            streamed(model, tmp_path / "s", shard, sink)
        published = StreamLedger(connect(redis_url), 1).published_ids()
        assert len(published) == N - 1 and calls[2] not in published

        # Given: a consumer that stopped while the store is full (epoch 2: one sample fills it)
        (tmp_path / "plane" / "refs.jsonl.consumer_done").write_text("")
        full = sink_for(tmp_path, redis_url, consumer, epoch=2, bound=1)
        # When/Then: the wait ends with a retryable error instead of waiting for ever
        with pytest.raises(ConsumerStopped, match="consumer stopped"):
            streamed(model, tmp_path / "s", shard, full, epoch=2)
        assert len(StreamLedger(connect(redis_url), 2).published_ids()) == 1
