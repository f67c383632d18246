"""The one-pass capture path streamed (the `captured` backend; the `vllm` backend shares its
path in extractor._engine_sample): each captured file is checked, published and freed, a
planted bad one is never published, and nothing is left on disk for the states."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import wait_until
from fakes import FakePublisher, StandInConsumer, stream_tensors
from specforge.runtime.data_plane.feature_store import LocalFeatureStore

from datagen.extraction.extractor import ExtractionConfig, Extractor
from datagen.generation.ledger import connect
from datagen.stream.ledger import StreamLedger
from datagen.stream.sink import StreamSink

sys.path.insert(0, str(Path(__file__).parents[1] / "extraction"))
from test_integrity import AUX, VOCAB, captured_shard  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from datagen.builders.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("m") / "llama", VOCAB, hidden_size=64,
                            num_layers=6)


def config(model: Path, run: Path, out: Path, **kw: object) -> ExtractionConfig:
    return ExtractionConfig(model_path=str(model), output_dir=str(out), aux_layer_ids=AUX,
                            dtype="float32", device="cpu", max_length=64, backend="captured",
                            run_dir=str(run), check_atol_nats=1e-3, check_positions_cpu=5,
                            writer_threads=1, max_pending_writes=1, **kw)


def test_captured_states_are_checked_published_once_and_freed(
        model: Path, tmp_path: Path, redis_url: str) -> None:
    # Given: three captured samples, the second's states planted one position late
    run = tmp_path / "run"
    shard = captured_shard(model, tmp_path, run)
    with Extractor(config(model, run, tmp_path / "files", keep_captured_states=True)) as ex:
        assert ex.run_shard(shard).written == 2
    files = {i: torch.load(next((tmp_path / "files").rglob(f"data_{i}.ckpt")),
                           weights_only=True) for i in (0, 2)}

    # When: the same shard is streamed
    store = LocalFeatureStore("consumer")
    with StandInConsumer(tmp_path / "plane", store) as consumer:
        sink = StreamSink(FakePublisher(tmp_path / "plane", store),
                          StreamLedger(connect(redis_url), 1), 1 << 30, poll_s=0.01)
        with Extractor(config(model, run, tmp_path / "stream", states_to="stream"),
                       sink=sink) as ex:
            result = ex.run_shard(shard)
        wait_until(lambda: len(consumer.acked()) == 2, 60, what="the two true samples")

    # Then: the two true samples reach the consumer once, equal to the file build; the
    # planted one fails its check and is never published; no states file is left behind
    assert result.written == 2
    assert [(f.idx, f.reason.split(":")[0]) for f in result.failures] == [(1, "state check")]
    got = dict(consumer.received)
    assert sorted(got) == ["B1/s0@e1", "B1/s2@e1"] and consumer.refs_seen == 2
    for i in (0, 2):
        expected = stream_tensors(files[i])
        assert all(torch.equal(got[f"B1/s{i}@e1"][k], v) for k, v in expected.items())
    assert not [p for p in (tmp_path / "stream").rglob("*") if p.is_file()
                and p.suffix in (".ckpt", ".tmp")]
    states = run / "states"
    assert not (states / "r0.safetensors").exists() and not (states / "r2.safetensors").exists()
    assert (states / "r0.safetensors.built").read_text().strip() == "B1/s0@e1"
    assert (states / "r1.safetensors").is_file()  # never published: kept
