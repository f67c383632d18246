"""The `vllm` backend streamed: the connector writes each sample's file, the extractor checks
it, publishes it and deletes it at once (a real vLLM 0.32 CPU engine, a tiny float32 Llama).
Slow (the engine's start-up: minutes on a loaded CPU)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import wait_until, write_jsonl
from fakes import FakePublisher, StandInConsumer, stream_tensors
from specforge.runtime.data_plane.feature_store import LocalFeatureStore
from vllm_fixture import vllm_python

from datagen.builders.tiny_model import build_tiny_llama
from datagen.extraction.backends.vllm import EngineOptions
from datagen.extraction.extractor import ExtractionConfig, Extractor
from datagen.generation.ledger import connect
from datagen.stream.ledger import StreamLedger
from datagen.stream.sink import StreamSink

N = 6


@pytest.mark.slow
def test_the_vllm_backends_files_are_published_once_and_deleted(tmp_path: Path,
                                                                 redis_url: str) -> None:
    # Given: a shard, its file build by the `hf` backend, and a vLLM engine backend
    python = vllm_python()
    model = build_tiny_llama(tmp_path / "model", 512, hidden_size=128, num_layers=8, heads=2)
    rng = random.Random(2)
    recs = [{"idx": i, "id": f"s{i}", "dataset": "B1",
             "prompt_ids": [rng.randrange(512) for _ in range(rng.randint(2, 20))],
             "output_ids": [rng.randrange(512) for _ in range(rng.randint(5, 60))]}
            for i in range(N)]
    shard = write_jsonl(tmp_path / "shard.jsonl", recs)
    base = {"model_path": str(model), "dtype": "float32", "device": "cpu", "max_length": 512}
    with Extractor(ExtractionConfig(output_dir=str(tmp_path / "hf"), **base)) as ex:
        assert ex.run_shard(shard).written == N
    store = LocalFeatureStore("consumer")

    # When: the shard is streamed through the engine
    with StandInConsumer(tmp_path / "plane", store) as consumer:
        sink = StreamSink(FakePublisher(tmp_path / "plane", store),
                          StreamLedger(connect(redis_url), 1), 1 << 30, poll_s=0.01)
        cfg = ExtractionConfig(output_dir=str(tmp_path / "vllm"), backend="vllm",
                               states_to="stream", engine=EngineOptions(
                                   python=python, args="--enforce-eager", inflight=2), **base)
        with Extractor(cfg, sink=sink) as ex:
            result = ex.run_shard(shard)
        wait_until(lambda: len(consumer.acked()) == N, 60, what="every sample acked")

    # Then: each sample once, the hf build's ids and masks, its states within the engine's
    # rounding; no file the connector wrote is left
    assert result.written == N and not result.failures and consumer.refs_seen == N
    got = dict(consumer.received)
    worst = 0.0
    for rec in recs:
        want = stream_tensors(torch.load(
            tmp_path / "hf" / f"rows_0-2000/data_{rec['idx']}.ckpt", weights_only=True))
        mine = got[f"B1/{rec['id']}@e1"]
        for key in ("input_ids", "loss_mask", "attention_mask"):
            assert torch.equal(mine[key], want[key]), key
        for key in ("hidden_state", "target"):
            assert mine[key].shape == want[key].shape and mine[key].dtype == want[key].dtype
            worst = max(worst, float((mine[key].float() - want[key].float()).norm()
                                     / want[key].float().norm()))
    assert worst < 0.03, worst
    assert not [p for p in (tmp_path / "vllm").rglob("*") if p.is_file()
                and p.name.endswith((".ckpt", ".tmp"))]
