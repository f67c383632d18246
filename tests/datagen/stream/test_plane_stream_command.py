"""`datagen stream`: the plane up, the consumer's config written and its command printed, the
plane held until the consumer is done."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import CLI_HANG_S

from datagen.stream import consumer as sc
from datagen.stream.plane import PlaneInfo


def handoff_file(tmp_path: Path) -> Path:
    """A run config as `datagen handoff` writes it (only its model and max_length are read)."""
    path = tmp_path / "specforge_train.json"
    path.write_text(json.dumps({
        "model": {"target_model_path": str(tmp_path / "model"),
                  "draft_model_config": str(tmp_path / "draft_config.json"),
                  "vocab_mapping_path": str(tmp_path / "vocab_mapping.pt"),
                  "torch_dtype": "bfloat16", "trust_remote_code": False},
        "data": {"hidden_states_path": str(tmp_path), "max_length": 40},
        "training": {"strategy": "eagle3"}}))
    return path


def stream_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", "stream", *args]


def test_stream_prints_the_consumer_line_and_holds_the_plane_until_done(tmp_path):
    stream_dir = tmp_path / "stream"
    proc = subprocess.Popen(
        stream_command("--samples", "3", "--epochs", "2", "--cpu", "--segment-mb", "64",
                       "--stream-dir", str(stream_dir), "--handoff", str(handoff_file(tmp_path))),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line.rstrip())
            if line.lstrip().startswith("train:"):
                break
        info = PlaneInfo.read(stream_dir)
        config = stream_dir / sc.CONSUMER_CONFIG_NAME
        assert lines[-1].strip() == f"train: {sc.consumer_command(config)}"
        assert f"DISAGG_STORE_ID={info.store_id}" in "\n".join(lines)
        body = json.loads(config.read_text())
        assert body["training"]["total_steps"] == 6  # 3 samples x 2 epochs, batch 1
        assert body["training"]["fsdp_sharding"] == "NO_SHARD"
        dis = body["deployment"]["disaggregated"]
        assert body["deployment"]["mode"] == "disaggregated" and dis["backend"] == "mooncake"
        assert (dis["store_id"], dis["mooncake_master_server_addr"]) == (info.store_id,
                                                                        info.master_addr)
        assert Path(dis["control_dir"]) / "refs.jsonl" == Path(info.channel_path)
        assert dis["consumer_state_dir"] == info.state_dir
        assert body["model"]["vocab_mapping_path"] == str(tmp_path / "vocab_mapping.pt")
        # SpecForge's own schema takes it as an online, disaggregated consumer run
        from specforge.config.schema import Config

        cfg = Config.from_file(str(config))
        assert cfg.mode == "online" and cfg.training.total_steps == 6
        os.kill(info.holder_pid, 0)  # the holder runs while the command holds the plane
        Path(info.channel_path + ".consumer_done").touch()
        assert proc.wait(timeout=CLI_HANG_S) == 0
        assert "consumer done" in proc.stdout.read()  # type: ignore[union-attr]
        assert not Path(f"/proc/{info.holder_pid}").exists()  # stopped (and reaped) with it
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stream_without_a_handoff_names_the_missing_file(tmp_path):
    out = subprocess.run(stream_command("--samples", "2", "--output-dir", str(tmp_path),
                                        "--handoff", str(tmp_path / "specforge_train.json")),
                         capture_output=True, text=True, timeout=CLI_HANG_S)
    assert out.returncode == 2
    assert "specforge_train.json is missing" in out.stderr and "datagen handoff" in out.stderr
    assert not (tmp_path / "stream").exists()  # nothing was started


def test_stream_without_a_training_set_says_to_prepare_one(tmp_path):
    # no handoff yet: the stream counts the draft vocabulary from the training set's ids
    out = subprocess.run(stream_command("--output-dir", str(tmp_path)),
                         capture_output=True, text=True, timeout=CLI_HANG_S)
    assert out.returncode == 2
    assert "no training set at" in out.stderr and "datagen prepare" in out.stderr
    assert not (tmp_path / "stream").exists()  # nothing was started


def test_the_segment_holds_twice_the_resident_bound_unless_told(capsys):
    # SpecForge frees an acknowledged sample only at its loader's next gc(): the store holds
    # more than the sink's bound for a while, so the holder's segment is twice the bound
    from types import SimpleNamespace

    from cli.stream import segment_bytes
    from datagen.stream.plane import SEGMENT_BYTES

    eight = SimpleNamespace(stream_resident_bytes=8 << 30)
    assert segment_bytes(eight, None) == 16 << 30
    assert segment_bytes(SimpleNamespace(stream_resident_bytes=1 << 20), None) == SEGMENT_BYTES
    assert segment_bytes(eight, 64) == 64 << 20
    assert "under twice stream_resident_bytes" in capsys.readouterr().err
    assert segment_bytes(eight, 16 << 10) == 16 << 30
    assert capsys.readouterr().err == ""
