"""A gpu worker that is a model replica over 2 ranks (gloo on the CPU), end to end: records ->
`datagen prepare` -> the `gpu` queue -> `datagen worker gpu --gpus cpu:2 --backend hf-tp` ->
files equal to the single-process `hf` backend's, for a tiny Llama and a tiny DeepseekV3."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CLI_HANG_S, Stack, wait_until
from test_extraction_e2e import datagen, manifest_idxs, shard_records, synthetic_records, unacked

from cli.stack import REPO, child_env
from datagen.builders.tiny_deepseek import build_tiny_deepseek_v3
from datagen.builders.tiny_model import build_tiny_llama
from datagen.extraction import ledger as xlm
from datagen.extraction.extractor import ExtractionConfig, Extractor
from datagen.extraction.manifest import MANIFEST_DIR, shard_name
from datagen.generation.ledger import connect
from datagen.training.training_set import extraction_dir

HIDDEN = 64
LAYERS = 6  # aux layers [1, 2, 2]


def build(kind: str, where: Path, vocab: int) -> Path:
    if kind == "llama":
        return build_tiny_llama(where, vocab, hidden_size=HIDDEN, num_layers=LAYERS)
    return build_tiny_deepseek_v3(where, vocab, hidden_size=HIDDEN, num_layers=LAYERS)


def replica(stack: Stack, **settings: Any):
    proc = stack.worker("gpu", gpus="cpu:2", extract_backend="hf-tp", **settings)
    wait_until(lambda: " ready." in proc.log_text() or not proc.alive(), 120,
               what="the replica consuming")
    assert proc.alive(), proc.log_text()[-3000:]
    return proc


def reference_files(model_path: Path, ref: Path, settings: Any, dtype: str) -> Path:
    """The same shards through the single-process `hf` backend."""
    cfg = ExtractionConfig(model_path=str(model_path), output_dir=str(ref), dtype=dtype,
                           batch_tokens=settings.extract_batch_tokens)
    with Extractor(cfg) as ex:
        for shard in sorted((Path(settings.output_dir) / "training/shards").glob("*.jsonl")):
            ex.run_shard(shard)
    return ref


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_hf_tp_replica_files_equal_the_single_process_hf_files(
        stack: Stack, encoder: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        kind: str) -> None:
    # Given: 12 samples in 3 shards, batches of ~4 samples packed into rows, bf16
    model_path = build(kind, tmp_path / "model", encoder.vocab_size)
    settings = stack.configure(server_url="http://127.0.0.1:9", model_path=str(model_path),
                               extract_batch_tokens=1000, shard_samples=4)
    out = Path(settings.output_dir)
    synthetic_records(out, encoder.vocab_size, 12)
    assert datagen(monkeypatch, stack, "prepare") == 0
    proc = replica(stack)

    # When: extracted through the queue by the replica
    code = datagen(monkeypatch, stack, "extract", "--interval", "0.3", "--timeout-s", "1200")

    # Then: every file equals the single-process forward's, within bf16 rounding
    assert code == 3  # synthetic_records' bad sample, dead-lettered alone
    log = proc.log_text()
    assert "replica of 2 ranks ready (hf-tp)" in log
    assert re.search(r"pack_tokens=4096", log), "rows are packed"
    ref16 = reference_files(model_path, out / "ref16", settings, "bfloat16")
    ref32 = reference_files(model_path, out / "ref32", settings, "float32")
    folder = extraction_dir(settings)
    samples = [s for s in shard_records(out) if s["id"] != "s3"]
    assert sorted(manifest_idxs(folder)) == sorted(s["idx"] for s in samples)
    err_tp = err_hf = 0.0
    for s in samples:
        got, want16, want32 = (load_one(d, s["idx"]) for d in (folder, ref16, ref32))
        assert torch.equal(got["input_ids"], want16["input_ids"])
        assert torch.equal(got["loss_mask"], want16["loss_mask"])
        for key in ("aux_hidden_state", "hidden_state"):
            assert got[key].dtype == torch.bfloat16 and got[key].shape == want16[key].shape
            exact = want32[key]
            err_tp = max(err_tp, float((got[key].float() - exact).abs().mean()))
            err_hf = max(err_hf, float((want16[key].float() - exact).abs().mean()))
    # "within bf16 rounding": the replica's bf16 states are as far from the float32 forward
    # as the single-process bf16 states are (sums in another order round differently)
    print(f"{kind}: mean abs error vs float32: hf-tp {err_tp:.3g}, hf {err_hf:.3g}")
    assert err_tp <= 1.5 * err_hf


def load_one(folder: Path, idx: int) -> dict[str, torch.Tensor]:
    [path] = folder.rglob(f"data_{idx}.ckpt")
    return torch.load(path, weights_only=True)


def rank_pids(proc: Any) -> dict[int, int]:
    return {int(r): int(p) for r, p in re.findall(r"replica rank (\d) pid (\d+)", proc.log_text())}


def log_time(line: str) -> float:
    stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})", line)
    assert stamp, line
    return time.mktime(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S")) + int(
        stamp.group(2)) / 1000


@pytest.mark.chaos
@pytest.mark.parametrize(("victim", "sig"), [(1, signal.SIGKILL), (0, signal.SIGKILL),
                                           (1, signal.SIGSTOP)], ids=["kill1", "kill0", "hang1"])
def test_a_killed_rank_takes_its_replica_down_and_the_shard_is_rerun_once_ahead_of_fresh_ones(
        stack: Stack, encoder: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        victim: int, sig: int) -> None:
    # Given: 4 shards of 20 samples, one sample per row, and two replicas A and B of 2 ranks
    model_path = build("llama", tmp_path / "model", encoder.vocab_size)
    settings = stack.configure(server_url="http://127.0.0.1:9", model_path=str(model_path),
                               extract_dtype="float32", extract_batch_tokens=200,
                               extract_writer_threads=2, shard_samples=20,
                               replica_timeout_s=5.0)  # a hung rank is given up after 5 s
    out = Path(settings.output_dir)
    n = 80
    synthetic_records(out, encoder.vocab_size, n)
    assert datagen(monkeypatch, stack, "prepare") == 0
    a, b = replica(stack), replica(stack)
    r = connect(stack.redis_url)
    owner_a = f"{os.uname().nodename}-{rank_pids(a)[0]}"
    reaper_b = f"{os.uname().nodename}-{rank_pids(b)[0]}"

    # When: A's rank `victim` is SIGKILLed (or stopped: it hangs) while A's shard is partly
    # written
    assert datagen(monkeypatch, stack, "extract", "--no-wait") == 0

    chosen: list[str] = []

    def a_mid_shard() -> bool:
        # mid-shard, with a sample's files already written (the manifest lists it): "handled"
        # counts forward passes, and the writer threads may lag behind them
        for shard, raw in r.hgetall(xlm.PROGRESS).items():
            p = json.loads(raw)
            if p["worker"] == owner_a and 3 <= p["handled"] < p["total"] and written(shard):
                chosen.append(shard)
                return True
        return False

    def written(shard: str) -> bool:
        manifest = extraction_dir(settings) / MANIFEST_DIR / f"{shard_name(shard)}.jsonl"
        return manifest.exists() and b"\n" in manifest.read_bytes()

    wait_until(a_mid_shard, 120, 0.01, what="A half way through a shard, a sample written")
    killed_shard = chosen[-1]
    os.kill(rank_pids(a)[victim], sig)
    killed_at = time.time()
    assert killed_shard is not None and not r.hexists(xlm.DONE, killed_shard)

    # Then: the shard is re-enqueued about one lease after the kill (not the visibility
    # timeout) by B's own reaper (nobody follows the run: `--no-wait`), A exits non-zero, and
    # B runs the killed shard before any fresh one
    def requeued() -> dict[str, Any] | None:
        raw = r.hget(xlm.RUNNING, killed_shard)
        entry = json.loads(raw) if raw else {}
        return entry if entry.get("requeued_at") else None

    wait_until(requeued, 180, 0.02, what="the killed shard re-enqueued")
    hang = settings.replica_timeout_s if sig == signal.SIGSTOP else 0.0
    entry = requeued()
    assert entry is not None and entry["requeued_by"] == reaper_b
    back = entry["requeued_at"]
    assert back - killed_at <= hang + settings.lease_s + 5
    wait_until(lambda: not a.alive(), 180, what="replica A down")
    # and no copy of the killed shard's message waits in kombu's hashes, to come back after
    # the visibility timeout (rank 0's solo pool ran the early ack only after the task)
    assert unacked(r) == (0, 0)
    assert a.proc.returncode != 0
    assert (f"rank {victim} exited with -9" if sig == signal.SIGKILL else
            f"rank 0 exited with 75, rank {victim} killed by the launcher") in a.log_text()
    # B alone does the rest (on a loaded 2-core machine that outlasted a 240 s follow)
    code = datagen(monkeypatch, stack, "extract", "--interval", "0.3", "--timeout-s", "1800")
    assert code == 3  # the one bad sample
    taken = [x for x in b.log_text().splitlines() if " taken by " in x]
    after = [x for x in taken if log_time(x) >= back - 0.002]  # log times are in ms
    assert after and f"shard {killed_shard} taken by" in after[0], taken

    # no half file, every sample once, the manifest and the ledger agree with the files
    folder = extraction_dir(settings)
    assert not [p for p in folder.rglob("*") if ".tmp-" in p.name]
    samples = [s for s in shard_records(out) if s["id"] != "s3"]
    idxs = manifest_idxs(folder)
    assert len(idxs) == len(set(idxs)) and sorted(idxs) == sorted(s["idx"] for s in samples)
    files = sorted(int(p.stem.split("_")[1]) for p in folder.rglob("data_*.ckpt"))
    assert files == sorted(idxs)
    for s in samples:
        data = load_one(folder, s["idx"])
        assert data["input_ids"].tolist() == s["prompt_ids"] + s["output_ids"]
    done = xlm.ExtractionLedger(r).done()
    assert len(done) == 4 and not r.hlen(xlm.RUNNING) and unacked(r) == (0, 0)
    assert sum(e["samples"] for e in done.values()) == len(samples)
    assert done[killed_shard]["skipped_done"] > 0  # the samples A finished were not redone


def test_a_replica_refuses_to_start_with_one_line(stack: Stack, tmp_path: Path) -> None:
    model = build("llama", tmp_path / "model", stack.encoder.vocab_size)
    cases = [  # (settings, what the one line must say)
        ({"model_path": str(model), "gpus": "0-7", "extract_backend": "hf-tp"},
         "gpus='0-7' asks for device 7 but 0 CUDA devices are visible"),
        ({"model_path": str(model), "gpus": "cpu:2"}, "runs on one device: use vllm, hf-tp"),
        ({"model_path": str(model), "gpus": "0-x"}, "expected device ids like 0-7"),
        ({"model_path": "", "gpus": "cpu:2", "extract_backend": "hf-tp"}, "model_path"),
    ]
    for values, says in cases:
        stack.configure(server_url="http://127.0.0.1:9", **values)
        result = subprocess.run([sys.executable, "-m", "cli.main", "worker", "gpu"], cwd=REPO,
                                env=child_env(stack.env), capture_output=True, text=True,
                                timeout=CLI_HANG_S)
        assert result.returncode == 2, (values, result.stderr[-2000:])
        assert says in result.stderr.strip().splitlines()[-1], result.stderr[-2000:]


def test_sigterm_stops_an_idle_replica_and_all_its_ranks_with_exit_0(stack: Stack, encoder: Any,
                                                         tmp_path: Path) -> None:
    # Given: an idle replica of 2 ranks
    model_path = build("llama", tmp_path / "model", encoder.vocab_size)
    stack.configure(server_url="http://127.0.0.1:9", model_path=str(model_path))
    proc = replica(stack)
    pids = rank_pids(proc)

    # When: the launcher is sent SIGTERM (as a supervisor stops it)
    os.kill(proc.pid, signal.SIGTERM)

    # Then: rank 0 stops consuming, tells rank 1 to stop, and the replica exits 0
    wait_until(lambda: not proc.alive(), 180, what="the replica stopped")
    assert proc.proc.returncode == 0, proc.log_text()[-3000:]
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_calibrate_measures_a_whole_replica_for_estimate(
        stack: Stack, encoder: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys) -> None:
    model_path = build("deepseek_v3", tmp_path / "model", encoder.vocab_size)
    stack.configure(server_url="http://127.0.0.1:9", model_path=str(model_path),
                    gpus="cpu:2", extract_backend="hf-tp", extract_dtype="float32")
    assert datagen(monkeypatch, stack, "calibrate", "--seq-len", "64", "--batches", "2") == 0
    cal = json.loads((Path(stack.settings().output_dir) / "calibration.json").read_text())
    assert cal["tokens_per_s"] > 0 and cal["device_name"] == "cpu x2 ranks (hf-tp)"
    capsys.readouterr()
    assert datagen(monkeypatch, stack, "estimate", "--tokens", "1000") == 0
    assert "calibrated on cpu x2 ranks (hf-tp)" in capsys.readouterr().out
