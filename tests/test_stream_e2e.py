"""Records streamed into SpecForge 0.2.0's stock consumer through the real queue, two epochs,
all real parts: Redis, `datagen prepare`, a gpu Celery worker with states_to = "stream" and the
`hf` backend on the tiny Llama, the Mooncake plane of `datagen stream` (a subprocess), and
`specforge train --role consumer` (with the CPU loss stand-in of
datagen/stream/cpu_consumer.py). The consumer's consumer.sqlite is the witness of what was
trained; the stream's published.jsonl of what was put, checked against a file build of the
same records.

Every streamed tensor is the file build's byte for byte (every digest), in both epochs: epoch 2
recomputes the states by prefill and publishes them in another order, each batch laid out for
the forward as in epoch 1. The state check runs in both (s3's wrong log-probabilities fail it
twice).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CLI_HANG_S, Stack, wait_until
from test_extraction_e2e import datagen, model_dir, records_with_logprobs, shard_records
from test_stream_consumer import CONSUMER_HANG_S, acked_rows, kill_group

from cli.stack import REPO
from datagen.extraction import ledger as xlm
from datagen.generation.ledger import connect
from datagen.stream import consumer as sc
from datagen.stream import cpu_consumer
from datagen.stream.plane import PlaneInfo
from datagen.stream.publisher import read_witness, stream_tensors, tensor_digest
from datagen.training.training_set import extraction_dir

__all__ = ["model_dir"]  # the tiny Llama fixture, shared with the extraction tests

BAD = "s3"  # records_with_logprobs gives s3 another sample's log-probabilities


def common(model: Path) -> dict[str, Any]:
    return {"server_url": "http://127.0.0.1:9", "model_path": str(model),
            "extract_dtype": "float32", "shard_samples": 4, "extract_retry_countdown_s": 0.1,
            "check_positions_cpu": 6}


def prepared(stack: Stack, model: Path, monkeypatch: pytest.MonkeyPatch, settings: Any, n: int,
             worker: str) -> tuple[Path, Any]:
    """n records with their log-probabilities prepared into shards under the settings'
    output folder, and a gpu worker (named ``worker``) up."""
    out = Path(settings.output_dir)
    records_with_logprobs(out, model, stack.encoder.vocab_size, n)
    assert datagen(monkeypatch, stack, "prepare") == 0
    gpu = stack.worker("gpu", name=worker)
    stack.wait_workers(1, [gpu])
    return out, gpu


def file_build(stack: Stack, model: Path, monkeypatch: pytest.MonkeyPatch, n: int
               ) -> tuple[dict[str, dict[str, dict[str, Any]]], Path]:
    """`datagen extract` of the records into .ckpt files: each sample's stream tensors'
    digests (renamed as publisher.stream_tensors does) by record id, and the handoff."""
    settings = stack.configure(output_dir=str(stack.tmp / "files"), **common(model))
    out, gpu = prepared(stack, model, monkeypatch, settings, n, "gpu-files")
    assert datagen(monkeypatch, stack, "extract", "--interval", "0.3", "--timeout-s",
                   str(CLI_HANG_S)) == 3  # s3 dead-lettered by the state check
    assert datagen(monkeypatch, stack, "handoff") == 0
    gpu.stop()
    folder = extraction_dir(settings)
    digests = {}
    for s in shard_records(out):
        if s["id"] != BAD:
            [path] = folder.rglob(f"data_{s['idx']}.ckpt")
            streamed = stream_tensors(torch.load(path, weights_only=True))
            digests[s["id"]] = {k: {"sha256": tensor_digest(t), "shape": list(t.shape),
                                    "dtype": str(t.dtype).removeprefix("torch.")}
                                for k, t in streamed.items()}
    connect(stack.redis_url).flushall()  # the stream's run starts on an empty ledger
    return digests, folder / "specforge_train.json"


class StreamRun:
    """`datagen stream` (the plane, held) and the stock consumer it prints the line of."""

    def __init__(self, tmp: Path, handoff: Path, samples: int, epochs: int):
        self.dir = tmp / "stream"
        self.log = tmp / "consumer.log"
        self.plane = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "stream", "--samples", str(samples),
             "--epochs", str(epochs), "--cpu", "--segment-mb", "128", "--stream-dir",
             str(self.dir), "--handoff", str(handoff)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in self.plane.stdout:  # type: ignore[union-attr]
            if line.lstrip().startswith("on a CPU:"):  # after the `specforge train` line
                break
        else:
            raise AssertionError(f"`datagen stream` exited {self.plane.wait()}")
        self.info = PlaneInfo.read(self.dir)
        # the consumer as the printed line starts it (SpecForge's CLI, the CPU stand-in)
        argv = shlex.split(line.split("on a CPU:", 1)[1].split("  (a stand-in")[0])
        assert argv[-4:] == ["--config", str(self.dir / sc.CONSUMER_CONFIG_NAME), "--role",
                             "consumer"], argv
        env = {k: v for k, v in os.environ.items() if k not in cpu_consumer.TORCHRUN_ENV}
        with open(self.log, "ab") as fh:
            self.consumer = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT,
                                             env=env, start_new_session=True)
        self.quantum = Path(self.info.channel_path + ".consumer_quantum")
        wait_until(lambda: self.quantum.exists() or self.consumer.poll() is not None,
                   CONSUMER_HANG_S, what="the consumer to come up")
        assert self.consumer.poll() is None, self.log.read_text()[-4000:]

    def done(self) -> bool:
        return Path(self.info.channel_path + ".consumer_done").exists()

    def acked(self) -> list[str]:
        return acked_rows(self.info.db_path)

    def plane_end(self) -> str:
        """What `datagen stream` printed last: it ends (0) once the consumer is done."""
        rest = self.plane.communicate(timeout=60)[0]
        assert self.plane.returncode == 0, rest
        return rest

    def stop(self) -> None:
        kill_group(self.consumer)
        if self.plane.poll() is None:
            self.plane.terminate()
            self.plane.wait(timeout=60)


def stream_settings(stack: Stack, model: Path, run: StreamRun, **more: Any) -> Any:
    return stack.configure(output_dir=str(stack.tmp / "stream_out"), states_to="stream",
                           stream_dir=str(run.dir), **{**common(model), **more})


def test_two_epochs_of_records_reach_the_stock_consumer_once_each_as_the_file_build(
        stack: Stack, model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    # Given: the file build of 6 records (s3's log-probabilities wrong: dead-lettered), the
    # plane of `datagen stream --samples 6 --epochs 2` and its consumer (horizon 12 steps)
    n = 6
    files, handoff = file_build(stack, model_dir, monkeypatch, n)
    ids = sorted(files)
    run = StreamRun(stack.tmp, handoff, n, 2)
    try:
        settings = stream_settings(stack, model_dir, run)
        out, gpu = prepared(stack, model_dir, monkeypatch, settings, n, "gpu-e1")

        # When: epoch 1 is extracted into the stream, then epoch 2 by a gpu worker restarted
        # with stream_epoch = 2
        assert datagen(monkeypatch, stack, "extract", "--interval", "0.3", "--timeout-s",
                       str(CLI_HANG_S)) == 3
        assert "stream closed" not in capsys.readouterr().out  # epoch 1 of 2: still open
        assert not Path(run.info.channel_path + ".closed").exists()
        gpu.stop()
        gpu = stack.worker("gpu", name="gpu-e2", stream_epoch=2)
        stack.wait_workers(1, [gpu])
        monkeypatch.setenv("DATAGEN_STREAM_EPOCH", "2")  # --epoch sets it: undone after
        assert datagen(monkeypatch, stack, "extract", "--epoch", "2", "--interval", "0.3",
                       "--timeout-s", str(CLI_HANG_S)) == 3
        assert "stream closed after epoch 2 of 2" in capsys.readouterr().out

        # Then: the consumer, 2 samples short of its horizon (s3 twice), ends (the channel
        # closed) with each sample acknowledged once per epoch, and nothing else
        wait_until(lambda: run.done() or run.consumer.poll() is not None, CONSUMER_HANG_S,
                   what="the consumer to end")
        assert run.done(), run.log.read_text()[-4000:]
        assert run.consumer.wait(timeout=CONSUMER_HANG_S) == 0, run.log.read_text()[-4000:]
        acked = run.acked()
        want = [f"B1/{i}@e{e}" for e in (1, 2) for i in ids]
        assert sorted(acked) == sorted(want) and len(acked) == len(set(acked))
        assert "the store holds 0 objects" in run.plane_end()  # all freed
    finally:
        run.stop()
    assert not list(out.rglob("*.ckpt")), "the stream wrote state files"

    # And: published.jsonl has one line per sample and epoch, each the file build's tensors
    # byte for byte (epoch 2's states recomputed), epoch 2 in another order
    lines = read_witness(run.dir)
    assert sorted(x["sample_id"] for x in lines) == sorted(want)
    for x in lines:
        record_id = x["sample_id"].split("/")[1].split("@")[0]
        assert x["epoch"] == int(x["sample_id"].rsplit("@e", 1)[1])
        assert x["tensors"] == files[record_id], x["sample_id"]
    order = {e: [x["sample_id"].split("@")[0] for x in lines if x["epoch"] == e] for e in (1, 2)}
    assert sorted(order[1]) == sorted(order[2]) and order[1] != order[2]
    letters = [json.loads(x) for x in
               (extraction_dir(settings) / "dead_letters.jsonl").read_text().splitlines()]
    assert [(x["id"], x["reason"].split(":")[0]) for x in letters] == [
        (BAD, "state check")] * 2  # once per epoch


@pytest.mark.chaos
def test_a_gpu_worker_sigkilled_mid_epoch_leaves_each_sample_acked_once(
        stack: Stack, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: 8 records in one shard streamed with room for one sample at a time, so the gpu
    # worker waits for the consumer's acks between puts
    n = 8
    files, handoff = file_build(stack, model_dir, monkeypatch, n)
    run = StreamRun(stack.tmp, handoff, n, 1)
    try:
        settings = stream_settings(stack, model_dir, run, stream_resident_bytes=1,
                                   shard_samples=n)
        out, gpu = prepared(stack, model_dir, monkeypatch, settings, n, "gpu-victim")
        assert datagen(monkeypatch, stack, "extract", "--no-wait") == 0

        # When: the worker is SIGKILLed after 2 puts, and another one takes over
        wait_until(lambda: len(read_witness(run.dir)) >= 2, CLI_HANG_S, 0.02,
                   what="two samples published")
        gpu.kill()
        r = connect(stack.redis_url)
        assert r.hlen(xlm.DONE) == 0, "the shard finished before the kill"
        before = len(read_witness(run.dir))
        gpu = stack.worker("gpu", name="gpu-after")
        stack.wait_workers(1, [gpu])
        assert datagen(monkeypatch, stack, "extract", "--interval", "0.3", "--timeout-s",
                       str(CLI_HANG_S)) == 3

        # Then: the consumer trained on each sample once and ended (the channel closed)
        wait_until(lambda: run.done() or run.consumer.poll() is not None, CONSUMER_HANG_S,
                   what="the consumer to end")
        assert run.done(), run.log.read_text()[-4000:]
        acked = run.acked()
        assert sorted(acked) == sorted(f"B1/{i}@e1" for i in files) == sorted(set(acked))
        assert before < n - 1  # the kill came with samples left to put
        assert "the store holds 0 objects" in run.plane_end()  # all freed
    finally:
        run.stop()
    assert not list(out.rglob("*.ckpt"))
