"""`make demo STREAM=1`: the demo's states streamed into SpecForge 0.2.0's stock consumer, two
epochs, all real parts (Redis, the simulator, Celery workers, `mooncake_master` and a segment
holder, `specforge train --role consumer` with the CPU stand-in of
datagen/stream/cpu_consumer.py). The consumer's own consumer.sqlite is the witness of what
trained; the stream's published.jsonl (each tensor's sha256) of what was put, checked here
against a file build of the same records: every tensor of every sample, in both epochs (the
second recomputed by prefill, in another order), is the file build's byte for byte.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from demo_runner import demo_env, run_demo

from cli.demo import EXTRACT_ENV
from cli.demo_stream import EPOCHS, acked
from cli.stack import REPO
from config.settings import load_settings
from datagen.extraction.extractor import Extractor
from datagen.extraction.runner import extraction_config
from datagen.stream.plane import PlaneInfo
from datagen.stream.publisher import read_witness, stream_tensors, tensor_digest
from datagen.stream.sink import sample_id
from datagen.training.training_set import extraction_dir, read_manifest, training_dir


def file_build(work: Path, out: Path) -> dict[str, dict[str, dict]]:
    """The demo's records extracted into .ckpt files under ``out`` (a copy of its training
    set), with the demo's extraction settings: each sample's stream tensors' digests (named as
    publisher.stream_tensors names them) by ``dataset/record id``."""
    shutil.copytree(work / "output" / "training" / "shards", training_dir(out) / "shards")
    shutil.copy(training_dir(work / "output") / "manifest.json", training_dir(out))
    settings = load_settings(work / "datagen.toml",
                             env={**EXTRACT_ENV, "DATAGEN_OUTPUT_DIR": str(out)})
    with Extractor(extraction_config(settings)) as ex:
        results = [ex.run_shard(out / s["path"]) for s in read_manifest(training_dir(out))
                   ["shards"]]
    assert not [f for r in results for f in r.failures], "the file build failed samples"
    digests = {}
    folder = extraction_dir(settings)
    for line in (folder / "manifest").glob("*.jsonl"):
        for entry in map(json.loads, line.read_text().splitlines()):
            tensors = stream_tensors(torch.load(folder / entry["path"], weights_only=True))
            digests[f"{entry['dataset']}/{entry['id']}"] = {
                k: {"sha256": tensor_digest(t), "shape": list(t.shape),
                    "dtype": str(t.dtype).removeprefix("torch.")} for k, t in tensors.items()}
    return digests


@pytest.mark.slow
@pytest.mark.timeout(3400)  # ~12-18 min here: the CPU trainer's ~550 steps set the pace
def test_the_demo_streams_every_sample_once_per_epoch_as_the_file_build(
        tmp_path: Path) -> None:
    # Given/When: the README's stream command (its folder moved to a temporary one)
    work = tmp_path / "demo"
    result = run_demo(["make", "demo", "STREAM=1", f"ARGS=--workdir {work}"],
                      timeout_s=3000, env=demo_env())
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "specforge train --config" in result.stdout

    # Then: no state file anywhere; the consumer acknowledged every published sample once
    assert not list(work.rglob("*.ckpt")), "the stream wrote state files"
    stream = work / "output" / "stream"
    done = acked(PlaneInfo.read(stream).db_path)
    assert len(done) == len(set(done)), [i for i, n in Counter(done).items() if n > 1]
    lines = read_witness(stream)
    assert sorted(done) == sorted(x["sample_id"] for x in lines)

    # And: every sample of the training set, once in each epoch, each tensor the file
    # build's byte for byte; epoch 2 in another order
    files = file_build(work, tmp_path / "files")
    assert len(files) > 200  # demo-sized
    for epoch in range(1, EPOCHS + 1):
        assert sorted(x for x in done if x.endswith(f"@e{epoch}")) == \
            sorted(sample_id(*key.split("/", 1), epoch) for key in files)
    for x in lines:
        key = x["sample_id"].rsplit("@e", 1)[0]
        assert x["tensors"] == files[key], x["sample_id"]
    order = {e: [x["sample_id"].rsplit("@e", 1)[0] for x in lines if x["epoch"] == e]
             for e in (1, 2)}
    assert order[1] != order[2]
    assert f"epoch 1: {len(files)} of {len(files)}, epoch 2: {len(files)} of " \
           f"{len(files)}; twice: 0; state files written: 0; objects left in the store: 0" \
           in result.stdout

    # And: the run's saved settings show each epoch's stream, against the demo's bound
    status = subprocess.run([sys.executable, "-m", "cli.main", "status", "--config",
                             str(work / "datagen.toml")], cwd=REPO, env=demo_env(),
                            capture_output=True, text=True, timeout=300)
    assert status.returncode == 0, status.stdout + status.stderr
    for epoch in (1, 2):
        assert f"stream epoch {epoch}: {len(files)} published, {len(files)} acknowledged, " \
               f"0.0 MiB resident of 16.0 MiB (stream_resident_bytes)" in status.stdout, \
               status.stdout


@pytest.mark.parametrize("variant", [["--server", "vllm"], ["--extract", "vllm"]])
def test_a_streamed_demo_on_vllm_is_refused_with_one_line(tmp_path: Path,
                                                           variant: list[str]) -> None:
    # Given/When: the stream asked of a demo whose states vLLM makes (captured: epoch 2 could
    # not recompute them; the vllm backend: not what the streamed demo runs)
    result = subprocess.run([sys.executable, "-m", "cli.main", "demo", "--stream", *variant,
                             "--workdir", str(tmp_path / "demo")], cwd=REPO, env=demo_env(),
                            capture_output=True, text=True, timeout=300)
    # Then: refused before anything starts, naming what runs
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout.strip() == ("demo --stream extracts with transformers (`hf`) into "
                                     "the stream, two epochs: it runs with --server simulator "
                                     "or sglang and --extract hf")
    assert not (tmp_path / "demo").exists()
