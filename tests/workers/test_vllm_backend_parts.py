"""The `vllm` backend's parts that need no engine (the engine itself: tests/real_vllm)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from config.settings import SettingsError, load_settings
from datagen.builders.tiny_kimi import build_tiny_kimi_k25
from datagen.extraction.backends.base import text_config
from datagen.extraction.backends.vllm import engine_python, loss_spans
from datagen.servers.capture import text_only, vllm_capture
from datagen.servers.launch import CPU_KV_CACHE_GIB, engine_env
from datagen.training.handoff import loss_mask


def test_every_engine_gets_the_connector_unbuffered_logs_and_the_operators_kv_cache(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: no KV-cache setting, then an operator's
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = engine_env()
    assert env["VLLM_CPU_KVCACHE_SPACE"] == CPU_KV_CACHE_GIB
    assert env["PYTHONUNBUFFERED"] == "1"
    root, other = env["PYTHONPATH"].split(":")
    assert (Path(root) / "datagen" / "extraction" / "vllm_connector.py").is_file()
    assert other == "/elsewhere"
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    assert engine_env()["VLLM_CPU_KVCACHE_SPACE"] == "7"


def test_capture_ids_are_layer_inputs_distinct_and_slots_keep_the_files_order() -> None:
    # SpecForge's [1, N//2-1, N-4] for 61 layers: outputs of layers 1, 29, 57 = vLLM inputs
    # of 2, 30, 58; the last layer's pre-norm output is vLLM's id 61
    assert vllm_capture([1, 29, 57], 61) == ([2, 30, 58, 61], [0, 1, 2, 3])
    # a 6-layer model's default [1, 2, 2]: vLLM keeps one state for the repeated id
    assert vllm_capture([1, 2, 2], 6) == ([2, 3, 6], [0, 1, 1, 2])
    # ids in any order: the file keeps the order asked for
    assert vllm_capture([4, 1], 8) == ([2, 5, 8], [1, 0, 2])


@pytest.mark.parametrize("n_prompt,length,spans", [
    (3, 10, ()), (0, 4, ()), (9, 9, ()), (2, 12, ((2, 5), (8, 12)))])
def test_loss_spans_are_the_runs_of_the_files_loss_mask(n_prompt, length, spans) -> None:
    mask = loss_mask(n_prompt, length, spans)
    got = torch.zeros(length, dtype=torch.int64)
    for start, end in loss_spans(mask):
        got[start:end] = 1
    assert got.tolist() == mask


def test_engine_python_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"vllm_python='/nowhere/python': no such file"):
        engine_python("/nowhere/python")
    assert engine_python(__file__) == __file__


def test_the_vllm_settings_are_checked() -> None:
    s = load_settings(None, env={"DATAGEN_EXTRACT_BACKEND": "vllm", "DATAGEN_VLLM_INFLIGHT": "8",
                                 "DATAGEN_VLLM_ARGS": "--quantization compressed-tensors"})
    assert (s.extract_backend, s.vllm_inflight, s.vllm_args) == (
        "vllm", 8, "--quantization compressed-tensors")
    with pytest.raises(SettingsError, match="vllm_inflight"):
        load_settings(None, env={"DATAGEN_VLLM_INFLIGHT": "0"})
    with pytest.raises(SettingsError, match="vllm_start_timeout_s"):
        load_settings(None, env={"DATAGEN_VLLM_START_TIMEOUT_S": "0"})


def test_a_kimi_k25_folder_gives_the_backend_its_text_shape_and_the_norm(tmp_path) -> None:
    """What the backend and its connector read from a folder laid out as Kimi-K2.5's."""
    folder = build_tiny_kimi_k25(tmp_path / "kimi", 512, hidden_size=128, num_layers=8)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "kimi_k25" and text_only(str(folder))
    text = text_config(str(folder))
    assert (text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]) == (128, 8, 512)
    assert text["kv_lora_rank"] + text["qk_rope_head_dim"] == 576  # vLLM's CPU MLA latent
    assert text["topk_method"] == "noaux_tc"
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        names = set(fh.keys())
    # the final norm the connector applies, under Kimi-K2.5's prefix
    assert "language_model.model.norm.weight" in names
    assert not any(n.startswith("model.") for n in names)


def test_a_write_that_never_ends_is_an_engine_lost_after_the_read_timeout(tmp_path) -> None:
    # Given: a running engine whose connector holds a file's lock and never releases it
    import fcntl
    import os
    from types import SimpleNamespace

    from datagen.errors import EngineLost
    from datagen.extraction.backends.vllm import VLLMBackend

    backend = VLLMBackend.__new__(VLLMBackend)
    backend.read_timeout_s = 0.2
    backend.server = SimpleNamespace(alive=lambda: True, proc=None, log_path="vllm.log")
    path = tmp_path / "data_0.ckpt"
    held = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(held, fcntl.LOCK_EX)

    # When / Then: the wait gives up with the engine's fault, not never
    try:
        with pytest.raises(EngineLost, match="still being written after 0 s"):
            backend._wait_written(path)
    finally:
        os.close(held)


def test_a_full_disk_under_the_connector_is_a_storage_error_not_a_lost_engine(
        tmp_path) -> None:
    # Given: a running engine whose connector's write of a file failed on a full disk: the
    # lock released with the error in it, no file
    import errno
    import os
    from types import SimpleNamespace

    from datagen.extraction.backends.vllm import VLLMBackend
    from datagen.extraction.state_sink import release_lock, write_failure

    backend = VLLMBackend.__new__(VLLMBackend)
    backend.read_timeout_s = 5.0
    backend.server = SimpleNamespace(alive=lambda: True, proc=None, log_path="vllm.log")
    path = tmp_path / "data_0.ckpt"
    lock = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    release_lock(lock, write_failure(path, OSError(errno.ENOSPC, "full"), 100))

    # When: the backend waits for it
    failed = backend._wait_written(path)

    # Then: the connector's error comes back (the extractor fails the shard as a storage
    # error and keeps the engine), naming the folder and its free space; the lock is gone
    assert isinstance(failed, OSError) and failed.errno == errno.ENOSPC
    assert f"under {tmp_path} (" in str(failed) and "bytes free" in str(failed)
    assert not os.path.exists(f"{path}.lock")
