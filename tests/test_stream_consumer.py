"""Samples streamed into SpecForge 0.2.0's stock consumer, all real parts: the Mooncake plane
(mooncake_master + segment holder), the project's handoff for the tiny Llama, Publisher, and
`specforge train --role consumer` run through SpecForge's own CLI entry (with the CPU loss
stand-in of datagen/stream/cpu_consumer.py). The consumer's own consumer.sqlite and log are
the witness."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import wait_until

from datagen.builders.tiny_model import build_tiny_llama
from datagen.extraction.files import Sample, sample_tensors
from datagen.stream import consumer as sc
from datagen.stream import cpu_consumer
from datagen.stream.plane import Plane, key_count
from datagen.stream.publisher import Publisher
from datagen.training import handoff
from datagen.training import vocab_mapping as vm

VOCAB = 300
HIDDEN = 32
LAYERS = 8
AUX = [1, 3, 4]
MAX_LENGTH = 40
N = 4
CONSUMER_HANG_S = 600  # a bound on a hung consumer, never a wait the test relies on


@pytest.fixture(scope="module")
def handoff_config(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """The project's own handoff (vocab mapping, draft config, run config) for the tiny
    Llama, from shard counts as extraction records them."""
    model = build_tiny_llama(tmp_path_factory.mktemp("model"), VOCAB, hidden_size=HIDDEN,
                             num_layers=LAYERS, tokenizer_dir=tokenizer_dir)
    folder = tmp_path_factory.mktemp("features")
    counts = vm.count_samples((f"rows_0/data_{i}.ckpt", s["input_ids"].tolist(),
                               s["loss_mask"].tolist()) for i, s in enumerate(samples()))
    vm.write_shard_counts(folder, "h-1", counts, {"aux_layer_ids": AUX,
                                                  "max_length": MAX_LENGTH,
                                                  "dtype": "bfloat16"})
    return handoff.write_handoff(folder, ["h-1"], str(model), 64, MAX_LENGTH).run_config


def samples() -> list[dict[str, torch.Tensor]]:
    """N samples of the tiny model's shapes, built as the file build builds them."""
    out = []
    for i in range(N):
        gen = torch.Generator().manual_seed(i)
        n = 12 + 3 * i
        sample = Sample(idx=i, id=f"s{i}", dataset="A1", n_prompt=5, truncated=False,
                        input_ids=torch.randint(0, VOCAB, (n,), generator=gen).tolist())
        aux = torch.randn(1, n, 3 * HIDDEN, generator=gen).bfloat16()
        final = torch.randn(1, n, HIDDEN, generator=gen).bfloat16()
        out.append(sample_tensors(sample, aux, final))
    return out


def start_consumer(config: Path, log: Path, *overrides: str) -> subprocess.Popen[bytes]:
    return cpu_consumer.start(config, log, *overrides)


def wait_consumer_up(publisher: Publisher, proc: subprocess.Popen[bytes], log: Path) -> None:
    wait_until(lambda: publisher.channel.consumer_quantum() is not None
               or proc.poll() is not None, timeout_s=CONSUMER_HANG_S,
               what="the consumer to come up")
    assert proc.poll() is None, log.read_text()[-4000:]


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def acked_rows(db: Path) -> list[str]:
    from cli.demo_stream import acked

    return acked(db)


def test_the_stock_consumer_trains_on_every_published_sample_once(tmp_path, handoff_config):
    plane = Plane(tmp_path / "stream", segment_bytes=256 << 20)
    with plane as info:
        body = sc.consumer_config(sc.read_handoff_config(handoff_config), info, samples=N,
                                  cpu=True)
        config = sc.write_consumer_config(plane.dir, body)
        log = tmp_path / "consumer.log"
        proc = start_consumer(config, log)
        try:
            publisher = Publisher(info)
            wait_consumer_up(publisher, proc, log)
            publisher.wait_ready(timeout_s=1)
            ids = [f"A1/s{i}@e1" for i in range(N)]
            for sid, tensors in zip(ids, samples(), strict=True):
                assert publisher.put(sid, tensors) > 0
            assert publisher.put(ids[0], samples()[0]) == 0  # a re-put publishes nothing
            publisher.close()
            assert proc.wait(timeout=CONSUMER_HANG_S) == 0, log.read_text()[-4000:]
        finally:
            kill_group(proc)
        text = log.read_text()
        assert publisher.consumer_done(), text[-4000:]
        assert publisher.acked() == set(ids)
        rows = acked_rows(info.db_path)
        assert sorted(rows) == sorted(ids)  # each acked once (sample_id is the key)
        from specforge.runtime.control_plane.metadata_store import SQLiteMetadataStore

        db = SQLiteMetadataStore(str(info.db_path))
        assert sorted(db.all_committed_ids()) == sorted(ids)
        marker = db.durable_marker()
        # one optimizer step a sample (batch 1): N steps, the last one durable
        assert marker["global_step"] == N and marker["optimizer_durable"]
        assert (Path(body["output_dir"]) / f"{info.store_id}-step{N}").is_dir()
        wait_until(lambda: key_count(info) == 0, timeout_s=60, what="the store to empty")


def test_a_consumer_killed_mid_run_resumes_from_its_checkpoint_and_trains_each_once(
        tmp_path, handoff_config):
    """SIGKILL the consumer after 2 of 4 optimizer steps (a checkpoint each step); restarted
    with training.resume_from, SpecForge releases what its ledger acked at that checkpoint and
    requeues the rest: the run ends at step 4 with every sample acked, none trained twice (a
    replayed sample would take a step and leave another unacked)."""
    from specforge.runtime.control_plane.metadata_store import SQLiteMetadataStore

    plane = Plane(tmp_path / "stream", segment_bytes=256 << 20)
    with plane as info:
        body = sc.consumer_config(sc.read_handoff_config(handoff_config), info, samples=N,
                                  cpu=True, save_interval=1)
        config = sc.write_consumer_config(plane.dir, body)
        ids = [f"A1/s{i}@e1" for i in range(N)]
        tensors = samples()
        log = tmp_path / "consumer.log"
        proc = start_consumer(config, log)
        try:
            publisher = Publisher(info)
            wait_consumer_up(publisher, proc, log)
            for sid, t in zip(ids[:2], tensors[:2], strict=True):
                publisher.put(sid, t)
            db = SQLiteMetadataStore(str(info.db_path))
            checkpoint = Path(body["output_dir"]) / f"{info.store_id}-step2"
            latest = Path(body["output_dir"]) / f"{info.store_id}-latest"
            # SpecForge acks an optimizer step before it saves that step's checkpoint (a
            # kill in between cannot be resumed: the ledger is ahead of every checkpoint),
            # so the kill waits for both, and for -latest to point at the new checkpoint
            wait_until(lambda: (db.durable_marker()["global_step"] == 2
                                and latest.resolve() == checkpoint.resolve())
                       or proc.poll() is not None, timeout_s=CONSUMER_HANG_S,
                       what="two durable optimizer steps and their checkpoint")
            assert proc.poll() is None, log.read_text()[-4000:]
            kill_group(proc)
            assert publisher.acked() == set(ids[:2])
            proc = start_consumer(config, log, f"training.resume_from={checkpoint}")
            for sid, t in zip(ids[2:], tensors[2:], strict=True):
                publisher.put(sid, t)
            publisher.close()
            assert proc.wait(timeout=CONSUMER_HANG_S) == 0, log.read_text()[-4000:]
        finally:
            kill_group(proc)
        assert publisher.consumer_done()
        assert sorted(acked_rows(info.db_path)) == sorted(ids)
        marker = SQLiteMetadataStore(str(info.db_path)).durable_marker()
        assert marker["global_step"] == N and marker["optimizer_durable"]
        wait_until(lambda: key_count(info) == 0, timeout_s=60, what="the store to empty")
