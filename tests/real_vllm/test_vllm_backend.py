"""The `vllm` extraction backend on a real vLLM (0.32, the CPU build in .venv-vllm).

Nothing stands in for vLLM here: each test starts the engine the backend starts (about a
minute and a half on 2 idle cores: three processes each import vLLM), so there are few tests,
each checking several things of one run. Where .venv-vllm is missing they skip with the
reason (`make vllm-env`); under CI=true they fail instead.
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Stack, manifest_idxs, wait_until, write_jsonl
from vllm_fixture import vllm_python

from datagen.builders.tiny_deepseek import build_tiny_deepseek_v3
from datagen.builders.tiny_kimi import build_tiny_kimi_k25
from datagen.builders.tiny_model import build_tiny_llama
from datagen.extraction import ledger as xlm
from datagen.extraction.backends.vllm import EngineOptions
from datagen.extraction.extractor import ExtractionConfig, Extractor
from datagen.generation.ledger import connect
from datagen.training.training_set import extraction_dir, read_manifest, training_dir

# vLLM's CPU attention takes head sizes of 32 and more (16 fails: "Unsupported CPU attention
# configuration: head_dim=16"): 128 hidden over 2 heads
HIDDEN, HEADS, LAYERS = 128, 2, 8
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB of KV cache: the default takes 4

pytestmark = [pytest.mark.timeout(1500), pytest.mark.usefixtures("cpu_hog")]


@pytest.fixture(autouse=True)
def engine_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in ENGINE_ENV.items():
        monkeypatch.setenv(key, value)


def engine_pids(folder: Path) -> set[int]:
    """Every vLLM process its logs name (API server, engine core, workers)."""
    pids: set[int] = set()
    for log in (folder / "logs").glob("vllm-*.log"):
        pids |= {int(p) for p in re.findall(r"pid=(\d+)\)", log.read_text(errors="replace"))}
    return pids


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")")[-1].split()[0] != "Z"


def datagen(monkeypatch: pytest.MonkeyPatch, stack: Stack, *argv: str) -> int:
    """`datagen ARGV` in this process, with the stack's settings in the environment."""
    from cli.main import main

    for key, value in stack.env.items():
        monkeypatch.setenv(key, value)
    return main(list(argv))


def records(out: Path, vocab: int, n: int, model: Path) -> None:
    """Records with the log-probabilities of their output ids (check_states): a generation
    server would answer them; here transformers in float32 on the same checkpoint, whose
    states equal vLLM's within 2e-6 (below), so a file that is the engine's passes the check
    and one out of line with its ids would not."""
    from transformers import AutoModelForCausalLM

    from datagen.generation.records import pack_logprobs

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    rng = random.Random(0)
    recs = [{"id": f"s{i}", "dataset": "B1", "rid": f"r{i}", "time": float(i),
             "messages": [{"role": "user", "content": "q"}], "truncated": False,
             "prompt_ids": [rng.randrange(vocab) for _ in range(rng.randint(5, 40))],
             "output_ids": [rng.randrange(vocab) for _ in range(rng.randint(100, 300))]}
            for i in range(n)]
    for rec in recs:
        ids, first = rec["prompt_ids"] + rec["output_ids"], len(rec["prompt_ids"]) - 1
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        rec["output_logprobs"] = pack_logprobs(
            [float(logp[first + i, t]) for i, t in enumerate(rec["output_ids"])])
    write_jsonl(out / "records" / "B1" / "w.jsonl", recs)


def extract_with_hf(model: Path, shards: list[Path], out: Path) -> None:
    cfg = ExtractionConfig(model_path=str(model), output_dir=str(out), dtype="float32",
                           device="cpu", max_length=512)
    with Extractor(cfg) as ex:
        for shard in shards:
            ex.run_shard(shard)


def specforge_counts(folder: Path, vocab: int) -> dict[int, int]:
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    return dict(count_effective_feature_tokens(str(folder), max_length=512,
                                               target_vocab_size=vocab))


@pytest.mark.chaos
def test_a_killed_vllm_replica_leaves_no_half_file_and_another_finishes_with_hfs_states(
        stack: Stack, encoder: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: a gpu worker on the vllm backend, a training set of 2 shards x 40 samples
    python = vllm_python()
    model = build_tiny_llama(tmp_path / "model", encoder.vocab_size, hidden_size=HIDDEN,
                             num_layers=LAYERS, heads=HEADS)
    n = 80
    settings = stack.configure(
        server_url="http://127.0.0.1:9", model_path=str(model), extract_dtype="float32",
        extract_backend="vllm", vllm_python=python, vllm_args="--enforce-eager",
        vllm_inflight=2, train_max_length=512, shard_samples=40, extract_batch_tokens=400)
    out = Path(settings.output_dir)
    records(out, encoder.vocab_size, n, model)
    assert datagen(monkeypatch, stack, "prepare") == 0
    folder = extraction_dir(settings)
    gpu = stack.worker("gpu")
    stack.wait_workers(1)

    # When: the worker (its Celery processes) is SIGKILLed while the engine writes a shard
    assert datagen(monkeypatch, stack, "extract", "--no-wait") == 0
    wait_until(lambda: len(manifest_idxs(folder)) >= 4, 900, 0.02, what="first samples")
    pids = engine_pids(folder)
    gpu.kill()
    r = connect(stack.redis_url)
    assert r.hlen(xlm.DONE) == 0, "a shard finished before the kill"
    killed_with = len(manifest_idxs(folder))

    # Then: the engine went with it (its launcher ends the group when the worker dies)
    assert len(pids) >= 3, pids
    wait_until(lambda: not any(alive(p) for p in pids), 30, 0.1, what="engine gone")

    # and a new worker (a new engine) finishes the set: nothing half-written, nothing
    # missing or twice, the samples written before the kill not redone
    stack.worker("gpu")
    assert datagen(monkeypatch, stack, "extract", "--interval", "0.5", "--timeout-s",
                   "1200") == 0
    idxs = manifest_idxs(folder)
    assert len(idxs) == len(set(idxs)) == n and len(idxs) > killed_with
    assert not [p for p in folder.rglob("*") if ".tmp-" in p.name or p.suffix == ".lock"]
    done = {k: json.loads(v) for k, v in r.hgetall(xlm.DONE).items()}
    assert sum(d["skipped_done"] for d in done.values()) >= killed_with > 0

    # Every file the engine wrote was checked against its record's log-probabilities
    # (before and after the kill), none failed, and the run's total counts each sample once
    lines = [json.loads(x) for p in (folder / "manifest").glob("*.jsonl")
             for x in p.read_text().splitlines() if x.strip()]
    assert all(e["checked"] > 0 and e["gap"] < 1e-3 for e in lines), lines[:3]
    total = json.loads((folder / "extraction.json").read_text())["state_check"]
    assert (total["checked"], total["failed"], total["unchecked"]) == (n, 0, 0), total

    # The engine's files equal transformers' for the same samples (float32: measured
    # <= 2e-6 apart), and SpecForge's own reader counts both folders alike
    shards = [out / s["path"] for s in read_manifest(training_dir(out))["shards"]]
    ref = tmp_path / "hf"
    extract_with_hf(model, shards, ref)
    theirs = sorted(folder.rglob("data_*.ckpt"))
    assert len(theirs) == n
    for path in theirs:
        got = torch.load(path, weights_only=True)
        want = torch.load(ref / path.relative_to(folder), weights_only=True)
        assert set(got) == set(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape
            torch.testing.assert_close(got[key], want[key], atol=1e-5, rtol=1e-5)
    assert specforge_counts(folder, encoder.vocab_size) == specforge_counts(
        ref, encoder.vocab_size)


@pytest.mark.parametrize("layout", ["deepseek_v3", "kimi_k25"])
def test_a_tiny_deepseek_v3_mla_and_moe_on_vllm_matches_transformers(
        tmp_path: Path, layout: str) -> None:
    """Kimi-K2.5's text backbone in small: MLA (latent 512 + 64, as vLLM's CPU kernel needs)
    and 8 routed experts with noaux_tc routing, as a plain DeepseekV3ForCausalLM and inside
    Kimi-K2.5's own wrapper (KimiK25ForConditionalGeneration, text_config, language_model.
    weights; vLLM skips the vision tower). transformers runs the same text weights. Float32
    states per sample within 3% (relative Frobenius norm) of transformers': measured
    0.4-1.6% (median 0.85%) over 12 samples, 1.4% at most through the wrapper (2026-12-04).
    vLLM's MLA computes attention in the absorbed latent form, transformers in the expanded
    one, and a small difference in a router score can move a token to another expert, so it
    is not float32 rounding; ids and loss masks are exact.

    The records here carry no log-probabilities, so these samples are counted `unchecked`:
    the `vllm` backend only prefills, so the engine gives none, and transformers' are not the
    engine's for these layouts (the 3% above). The state check runs on them against a vLLM
    server's own log-probabilities in tests/real_vllm/test_capture_models.py."""
    python = vllm_python()
    if layout == "kimi_k25":
        engine_model = build_tiny_kimi_k25(tmp_path / "kimi", 512, hidden_size=128,
                                           num_layers=8)
        config = json.loads((engine_model / "config.json").read_text())
        assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
        model = engine_model / "text-backbone"  # the same weights, for transformers
    else:
        model = engine_model = build_tiny_deepseek_v3(tmp_path / "dsv3", 512, hidden_size=128,
                                                      num_layers=8, for_vllm=True)
    rng = random.Random(1)
    recs = [{"idx": i, "id": f"s{i}", "dataset": "d",
             "prompt_ids": [rng.randrange(512) for _ in range(rng.randint(1, 20))],
             "output_ids": [rng.randrange(512) for _ in range(rng.randint(5, 80))]}
            for i in range(12)]
    shard = write_jsonl(tmp_path / "shard.jsonl", recs)
    cfg = ExtractionConfig(model_path=str(engine_model), output_dir=str(tmp_path / "vllm"),
                           dtype="float32", device="cpu", max_length=512, backend="vllm",
                           engine=EngineOptions(python=python, args="--enforce-eager"))
    with Extractor(cfg) as ex:
        assert ex.aux_layer_ids == (1, 3, 4)
        result = ex.run_shard(shard)
    assert result.written == 12 and not result.failures
    extract_with_hf(model, [shard], tmp_path / "hf")
    worst = 0.0
    for rec in recs:
        rel = f"rows_0-2000/data_{rec['idx']}.ckpt"
        got = torch.load(tmp_path / "vllm" / rel, weights_only=True)
        want = torch.load(tmp_path / "hf" / rel, weights_only=True)
        assert got["input_ids"].tolist() == rec["prompt_ids"] + rec["output_ids"]
        assert torch.equal(got["loss_mask"], want["loss_mask"])
        for key in ("aux_hidden_state", "hidden_state"):
            assert got[key].shape == want[key].shape and got[key].dtype == torch.float32
            worst = max(worst, float((got[key] - want[key]).norm() / want[key].norm()))
    assert worst < 0.03, worst
