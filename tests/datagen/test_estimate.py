"""Planning arithmetic, disk check and calibration file; the module must not need torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from datagen.extraction import estimate as est

ROOT = Path(__file__).resolve().parents[2]

# The run this design is based on: 8 datasets at 10M tokens, one at 45M, one at 12.5M.
ORIGINAL_RUN = {**{f"B{i}": 10_000_000 for i in range(1, 9)},
                "A1": 45_000_000, "A2": 12_500_000}


def test_import_does_not_load_torch():
    code = ("import sys, datagen.extraction.estimate; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_original_run_arithmetic():
    plan = est.estimate(ORIGINAL_RUN, hidden_size=7168, num_layers=61, tokens_per_s=530,
                        n_gpus=1, dtype_bytes=2)
    tokens = 137_500_000
    assert plan.total_tokens == tokens
    assert plan.bytes_per_token == 4 * 7168 * 2 + 16 == 57_360
    assert plan.total_bytes == tokens * 4 * 7168 * 2 + tokens * 16 == 7_887_000_000_000
    assert plan.hours == pytest.approx(tokens / 530 / 3600)
    assert plan.aux_layer_ids == (1, 29, 57)
    by_name = {d.name: d for d in plan.datasets}
    assert by_name["A1"].bytes == 45_000_000 * 57_360
    assert by_name["B3"].hours == pytest.approx(10_000_000 / 530 / 3600)
    assert sum(d.bytes for d in plan.datasets) == plan.total_bytes


def test_text_shows_the_arithmetic():
    plan = est.estimate(ORIGINAL_RUN, hidden_size=7168, num_layers=61, tokens_per_s=34_000,
                        n_gpus=8)
    text = plan.text
    assert "137,500,000 tokens x 57,360 B = 7,887,000,000,000 B = 7.89 TB" in text
    assert "(34,000 tokens/s x 8 GPUs) / 3600 = 0.1 h" in text
    assert "H 7168 x 2 B = 57,344 B of states + 16 B (ids, mask) = 57,360 B" in text
    assert text.count("\n") == len(ORIGINAL_RUN) + 5


def test_gpus_divide_time_not_disk():
    one = est.estimate({"x": 10**9}, 4096, 32, tokens_per_s=34_000, n_gpus=1)
    eight = est.estimate({"x": 10**9}, 4096, 32, tokens_per_s=34_000, n_gpus=8)
    assert eight.hours == pytest.approx(one.hours / 8)
    assert eight.total_bytes == one.total_bytes == 10**9 * (32 * 1024 + 16)


def test_default_aux_layers_match_specforge():
    assert est.default_aux_layer_ids(32) == (1, 15, 28)
    with pytest.raises(ValueError):
        est.default_aux_layer_ids(3)


def test_check_disk_refuses_when_too_big_and_passes_with_override(tmp_path, monkeypatch):
    monkeypatch.setattr(est.shutil, "disk_usage", lambda _p: SimpleNamespace(free=10**9))
    target = tmp_path / "not" / "yet" / "created"
    need = 10**6 * (4 * 4096 * 2 + 16)
    with pytest.raises(est.InsufficientDiskSpace) as err:
        est.check_disk(target, 10**6, 4096, 2)
    msg = str(err.value)
    assert "need 32.8 GB" in msg and "1.0 GB free at" in msg and "--force" in msg
    assert str(tmp_path) in msg  # reports the nearest existing folder
    assert est.check_disk(target, 10**6, 4096, 2, override=True) == need
    assert est.check_disk(target, 1000, 4096, 2) == 1000 * (4 * 4096 * 2 + 16)


def test_calibration_file_roundtrip(tmp_path):
    path = tmp_path / "cal" / "h200.json"
    saved = est.save_calibration(path, "/models/llama-8b", "NVIDIA H200", 34123.4)
    loaded = est.load_calibration(path)
    assert loaded == saved
    assert loaded.tokens_per_s == 34123.4


def test_calibrate_runs_the_extraction_forward(tmp_path):
    from datagen.builders.tiny_model import build_tiny_llama

    model = build_tiny_llama(tmp_path / "m", 128, hidden_size=32, num_layers=4)
    from datagen.extraction.extractor import calibrate

    rate = calibrate(str(model), seq_len=32, n_batches=2, device="cpu", dtype="float32")
    assert rate > 0


def test_capture_plans_no_forward_and_counts_the_captured_files_on_disk():
    # Given: the seed's run planned with capture_states (no extraction rate to give)
    plan = est.estimate(ORIGINAL_RUN, hidden_size=7168, num_layers=61, tokens_per_s=0,
                        n_gpus=1, dtype_bytes=2, captured=True)

    # Then: no forward hours, the training folder as without capture, and the captured
    # files (4 states x H x 2 B + 8 B of int64 ids per position) beside it until it is built
    tokens = 137_500_000
    assert plan.hours == 0 and all(d.hours == 0 for d in plan.datasets)
    assert plan.total_bytes == tokens * 57_360
    assert plan.states_bytes == tokens * (4 * 7168 * 2 + 8) == 7_885_900_000_000
    # the build frees each file once its row is durable: the larger total, plus the rows
    # the 4 writer threads hold (2,048 positions each)
    assert plan.peak_bytes == plan.total_bytes + 4 * 2048 * 57_360
    text = plan.text
    assert "states = 137,500,000 tokens x 57,352 B" in text
    assert "peak  = max(7.89 TB rows, 7.89 TB states) + 0.5 GB of rows being written = " \
           "7.89 TB" in text
    assert "0 h of extraction forward" in text and "57,344 B per token" in text
    # and with keep_captured_states both stay
    kept = est.estimate(ORIGINAL_RUN, hidden_size=7168, num_layers=61, tokens_per_s=0,
                        n_gpus=1, dtype_bytes=2, captured=True, keep_states=True)
    assert kept.peak_bytes == plan.total_bytes + plan.states_bytes
    assert "peak  = 7.89 TB + 7.89 TB = 15.77 TB" in kept.text
    # and without capture a rate is still required
    with pytest.raises(ValueError):
        est.estimate(ORIGINAL_RUN, 7168, 61, tokens_per_s=0)


def test_estimate_command_takes_capture_without_a_rate():
    result = subprocess.run(
        [sys.executable, "-m", "cli.main", "estimate", "--preset", "kimi-k2.5", "--tokens",
         "137500000", "--capture"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "none needed" in result.stdout and "= 7.89 TB: each captured file is freed" in \
        result.stdout


def test_the_stream_plans_no_disk_its_resident_bound_and_a_prefill_per_epoch():
    # Given: the seed's run captured while generating, streamed for two epochs under 8 GiB,
    # recomputed at 6,250 prefill tokens/s on each of 8 GPUs (one Kimi-K2.5 node's ~50k)
    bound = 8 * 2**30
    plan = est.estimate(ORIGINAL_RUN, hidden_size=7168, num_layers=61, tokens_per_s=6250,
                        n_gpus=8, dtype_bytes=2, captured=True, max_length=2048,
                        stream_bound=bound, epochs=2)

    # Then: no disk for states, the store's bytes per token are the stream's (3 int64 rows)
    tokens = 137_500_000
    assert plan.peak_bytes == 0
    st = plan.stream
    assert st.bytes_per_token == 4 * 7168 * 2 + 24 == 57_368
    assert st.samples_resident == bound // (2048 * 57_368) == 73
    # the captured first epoch costs no forward; the second is a prefill of every token
    assert st.first_epoch_hours == 0
    assert st.hours == pytest.approx(tokens / (6250 * 8) / 3600)
    text = plan.text
    assert "disk for states = 0 B" in text and "73 samples of train_max_length" in text
    assert "= 0.8 h of forward in all" in text
    # and without capture every epoch is a prefill, the first included
    plain = est.estimate(ORIGINAL_RUN, 7168, 61, tokens_per_s=6250, n_gpus=8,
                         stream_bound=bound, epochs=2)
    assert plain.stream.hours == pytest.approx(2 * tokens / (6250 * 8) / 3600)
    # a bound below one sample says so; a second epoch of captured states needs a rate
    small = est.estimate(ORIGINAL_RUN, 7168, 61, tokens_per_s=1, stream_bound=1000)
    assert "NOT ONE sample" in small.text
    with pytest.raises(ValueError, match="recomputes the states by prefill"):
        est.estimate(ORIGINAL_RUN, 7168, 61, tokens_per_s=0, captured=True,
                     stream_bound=bound, epochs=2)


def test_estimate_command_plans_the_stream_for_the_public_drafters_six_billion_tokens():
    result = subprocess.run(
        [sys.executable, "-m", "cli.main", "estimate", "--preset", "kimi-k2.5", "--tokens",
         "6000000000", "--stream", "--epochs", "2", "--tokens-per-s", "6250", "--gpus", "8",
         "--resident-bytes", str(64 * 2**30)], cwd=ROOT, capture_output=True, text=True,
        timeout=120, env={k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")})
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "as files = 6,000,000,000 tokens x 57,360 B = 344,160,000,000,000 B" in out
    assert "resident <= 68.7 GB in the store" in out and "disk for states = 0 B" in out
    assert "each further one a prefill from the records (33.3 h) = 66.7 h" in out
