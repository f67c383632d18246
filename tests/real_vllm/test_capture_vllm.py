"""capture_states on a real vLLM 0.32 generation server (the CPU build in .venv-vllm): the
states written in the generation pass, and SpecForge's folder built from them with no
extraction forward pass.

One server for the module (an engine start is 70-100 s on 2 cores), launched as
tests/real_vllm/test_vllm_server.py launches it plus datagen.servers.capture.server_args, on a tiny
random Llama (8 layers, H=128) in float32 built here; its connector may write under one run
folder's ``states/`` only, which every test here uses. The last test stops it before the
`vllm` extraction backend starts its own engine (one engine at a time on this host).

Measured (2026-12-04, 2 shared cores): a file released 0.02-0.10 s after the answer on an
idle server; generation-pass states vs a transformers float32 forward max |diff| 1.5e-6
(final, post-norm) and 1.2e-7 (aux), relative 3e-7; the captured folder vs a `vllm` backend
prefill of the same ids max |diff| 0.0 in float32; `datagen run` 15.7 s for 12 samples, the
folder built by the `captured` backend in 5.4 s.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Stack, write_jsonl
from vllm_fixture import (
    GenerationServer,
    configure_on,
    datagen_run,
    start_generation_server,
    vllm_python,
)

from datagen.client import SGLangClient, new_rid
from datagen.extraction.backends.vllm import EngineOptions
from datagen.extraction.extractor import ExtractionConfig, Extractor
from datagen.generation.ledger import Ledger
from datagen.generation.records import (
    iter_records,
    pack_logprobs,
    records_dir,
    unpack_logprobs,
)
from datagen.servers import capture
from datagen.training.training_set import extraction_dir, read_manifest, training_dir

pytestmark = [pytest.mark.timeout(1800), pytest.mark.usefixtures("cpu_hog_module")]

CONTEXT = 1024
HIDDEN, HEADS, LAYERS = 128, 2, 8
AUX = (1, 3, 4)  # SpecForge's default for 8 layers
# bf16's unit roundoff: what "equal within bf16 rounding" allows, relative to each value
BF16_RTOL = 2.0 ** -8


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, encoder: Any) -> Path:
    from datagen.builders.tiny_model import build_tiny_llama

    vllm_python()  # skip (or fail in CI) before building anything
    return build_tiny_llama(tmp_path_factory.mktemp("capture") / "model", encoder.vocab_size,
                            hidden_size=HIDDEN, num_layers=LAYERS, heads=HEADS,
                            tokenizer_dir=tokenizer_dir)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("run") / "out"


@pytest.fixture(scope="module")
def vllm(model: Path, run_dir: Path, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[GenerationServer]:
    started = time.monotonic()
    server = start_generation_server(
        model, tmp_path_factory.mktemp("logs") / "vllm.log", CONTEXT,
        extra_args=capture.server_args(str(model), run_dir, "float32", AUX))
    print(f"FIGURE vLLM capture server ready after {time.monotonic() - started:.0f} s")
    yield server
    server.stop()


def transformers_states(model: Path, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [L, 3H], post-norm final [L, H]) of one float32 forward over ``ids``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1][0] for i in AUX], dim=-1), hs[-1][0]


def load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_one_request_alone_gets_its_file_on_an_idle_server_equal_to_a_prefill(
        vllm: GenerationServer, model: Path, run_dir: Path) -> None:
    # Given: one request, nothing else on the server before or after it
    client, rid = SGLangClient(vllm.url, kind="vllm"), new_rid("idle")
    path = capture.states_path(run_dir, "idle", rid)
    prompt = [1, 4, 17, 99, 250, 7, 8, 9]

    # When: it is generated with capture on, and the server has nothing more to do
    gen = client.generate(prompt, {"max_new_tokens": 12, "temperature": 0}, rid,
                          extra={"kv_transfer_params": capture.request_params(path)})
    answered = time.monotonic()

    # Then: the file is written all the same (the engine steps until its connector is done),
    # holding prompt + output minus the last id, the lock released
    assert capture.wait_released(path, 60)
    written_s = time.monotonic() - answered
    ids = prompt + gen.output_ids[:-1]
    assert capture.check_file(path, ids) == path.stat().st_size
    got = load(path)
    assert got["aux_hidden_state"].shape == (len(ids), 3 * HIDDEN)
    assert got["hidden_state"].dtype == torch.float32

    # and its states are a transformers prefill's over the same ids (float32)
    aux, final = transformers_states(model, ids)
    diffs = {k: float((got[k] - want).abs().max()) for k, want in
             (("aux_hidden_state", aux), ("hidden_state", final))}
    rel = {k: float((got[k] - want).norm() / want.norm()) for k, want in
           (("aux_hidden_state", aux), ("hidden_state", final))}
    print(f"FIGURE idle server: file released {written_s:.3f} s after the answer; float32 "
          f"generation pass vs transformers prefill, max |diff| {diffs}, relative {rel}")
    torch.testing.assert_close(got["aux_hidden_state"], aux, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got["hidden_state"], final, atol=1e-4, rtol=1e-4)


def test_an_aborted_request_leaves_its_lock_released_and_no_file(
        vllm: GenerationServer, run_dir: Path) -> None:
    client, rid, out = SGLangClient(vllm.url, kind="vllm"), new_rid("abort"), {}
    path = capture.states_path(run_dir, "abort", rid)
    thread = threading.Thread(target=lambda: out.update(gen=client.generate(
        [1, 5, 6], {"max_new_tokens": 900, "ignore_eos": True}, rid,
        extra={"kv_transfer_params": capture.request_params(path)})), daemon=True)
    # (aborted mid-decode with the engine stopped: in CI a request aborted "at once" on a
    # running engine once ran its 900 tokens before the abort came)

    def abort() -> None:
        assert thread.is_alive() and not out
        assert Path(f"{path}.lock").exists()  # the connector holds it from the first step
        client.abort(rid)
    vllm.abort_mid_decode(rid, thread.start, abort)
    thread.join(60)
    assert out["gen"].aborted and len(out["gen"].output_ids) < 900
    assert capture.wait_released(path, 60)
    assert not path.exists()


def planted(path: Path, to: Path, plant: Any) -> None:
    """A copy of the captured file ``path`` at ``to``, its tensors changed by ``plant``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata()
        tensors = {k: fh.get_tensor(k).clone() for k in fh.keys()}
    plant(tensors)
    to.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(to), meta)


def random_bits(like: torch.Tensor) -> torch.Tensor:
    """float32 random bits shaped as ``like``: what a buffer never written may hold."""
    return torch.randint(-2 ** 31, 2 ** 31 - 1, like.shape, dtype=torch.int32,
                         generator=torch.Generator().manual_seed(0)).view(torch.float32)


def shift_one_decode_step(t: dict[str, torch.Tensor]) -> None:
    """The aux rows of one decode step written a position late (step 12's at 13)."""
    t["aux_hidden_state"][13] = t["aux_hidden_state"][12].clone()


def garbage_aux_block(t: dict[str, torch.Tensor]) -> None:
    """A block of 16 positions of finite garbage in the aux states (another request's)."""
    block = t["aux_hidden_state"][8:24]
    block.copy_(torch.randn(block.shape, generator=torch.Generator().manual_seed(1)))


def prompt_garbage(t: dict[str, torch.Tensor]) -> None:
    """Finite garbage in the prompt's positions but its last (a prefill chunk gone wrong)."""
    g = torch.Generator().manual_seed(2)
    for key in ("aux_hidden_state", "hidden_state"):
        t[key][:7].copy_(torch.randn(t[key][:7].shape, generator=g))


PLANTS = {  # idx: (what, how)
    0: ("as written", lambda t: None),
    1: ("nan", lambda t: t["hidden_state"].__setitem__((2, 5), float("nan"))),
    2: ("unwritten aux block", lambda t: t["aux_hidden_state"][8:24].copy_(
        random_bits(t["aux_hidden_state"][8:24]))),
    3: ("aux step shifted", shift_one_decode_step),
    4: ("garbage aux block", garbage_aux_block),
    5: ("prompt garbage", prompt_garbage),
}


def test_planted_faults_in_captured_files_are_each_dead_lettered(
        vllm: GenerationServer, model: Path, run_dir: Path, tmp_path: Path) -> None:
    # Given: six samples generated with capture and the server's logprobs, the prompt's too
    # (as a worker asks them with check_prompt_states), 8 prompt ids and 24 output ids
    # each, their files copied with one fault planted each (PLANTS), the first as the server
    # wrote it
    client = SGLangClient(vllm.url, kind="vllm")
    recs = []
    for idx, (_, plant) in PLANTS.items():
        rid = new_rid("plant")
        path = capture.states_path(run_dir, "plant", rid)
        prompt = [1, 4, 17, 99, 250, 7, 8 + idx, 9]
        gen = client.generate(prompt, {"max_new_tokens": 24, "temperature": 0,
                                       "ignore_eos": True}, rid, logprobs=True,
                              prompt_logprobs=True,
                              extra={"kv_transfer_params": capture.request_params(path)})
        assert capture.wait_released(path, 60)
        planted(path, run_dir / "states" / "planted" / f"{idx}.safetensors", plant)
        recs.append({"idx": idx, "id": f"p{idx}", "dataset": "plant", "prompt_ids": prompt,
                     "output_ids": gen.output_ids, "states": f"states/planted/{idx}.safetensors",
                     "output_logprobs": pack_logprobs(gen.logprobs),
                     "prompt_logprobs": pack_logprobs(gen.prompt_logprobs)})
    assert all(len(r["output_ids"]) == 24 for r in recs)
    assert all(len(unpack_logprobs(r["prompt_logprobs"])) == 7 for r in recs)
    shard = write_jsonl(tmp_path / "shard.jsonl", recs)

    def build(share: float) -> Any:
        cfg = ExtractionConfig(model_path=str(model), output_dir=str(tmp_path / f"hs{share}"),
                               aux_layer_ids=AUX, dtype="float32", device="cpu",
                               max_length=64, backend="captured", run_dir=str(run_dir),
                               keep_captured_states=True, check_positions_cpu=0,
                               recapture_share=share, server_url=vllm.url)
        with Extractor(cfg) as ex:
            return ex.run_shard(shard)

    # When: the captured backend builds the rows, every sample re-captured on the server
    result = build(1.0)

    # Then: the true file is written; each planted fault is dead-lettered: the NaN and the
    # unwritten block as non-finite states (tensor and first position named), the prompt
    # garbage by the prompt's log-probabilities (checked before the re-capture runs), the
    # shifted step and the garbage block by the re-capture, which names the layer and the
    # position
    assert result.written == 1
    reasons = {f.idx: f.reason for f in result.failures}
    assert sorted(reasons) == [1, 2, 3, 4, 5], reasons
    assert "hidden_state holds 1 values that are not finite" in reasons[1]
    assert "first at position 2" in reasons[1]
    first = re.search(r"aux_hidden_state holds [\d,]+ values that are not finite .*the first "
                      r"at position (\d+)", reasons[2])
    assert first and 8 <= int(first.group(1)) < 24, reasons[2]
    where = {i: re.search(r"re-capture: (.*) \((\w+)\) at position (\d+)", reasons[i])
             for i in (3, 4)}
    assert all(where.values()), reasons
    assert where[3].group(2) == "aux_hidden_state" and where[3].group(3) == "13"
    assert where[4].group(2) == "aux_hidden_state" and 8 <= int(where[4].group(3)) < 24
    prompt_check = re.compile(r"do not give the server's log-probabilities.* at position "
                              r"(\d+) past")
    assert (found := prompt_check.search(reasons[5])) and int(found.group(1)) < 7, reasons[5]
    assert result.check.failed == 5 and result.check.checked == 6
    print(f"FIGURE planted faults: {reasons}")

    # And: without the re-capture, the prompt garbage is still caught at a prompt position by
    # the prompt's log-probabilities; the shifted step and the garbage aux block pass the
    # log-probability check (what it cannot see: DESIGN.md)
    unchecked = build(0.0)
    reasons = {f.idx: f.reason for f in unchecked.failures}
    assert sorted(reasons) == [1, 2, 5], reasons
    assert (found := prompt_check.search(reasons[5])) and int(found.group(1)) < 7, reasons[5]


def datagen(monkeypatch: pytest.MonkeyPatch, stack: Stack, *argv: str) -> int:
    """`datagen ARGV` in this process, with the stack's settings in the environment."""
    from cli.main import main

    for key, value in stack.env.items():
        monkeypatch.setenv(key, value)
    return main(list(argv))


def test_a_run_with_capture_builds_specforge_files_equal_to_a_vllm_extraction(
        stack: Stack, vllm: GenerationServer, model: Path, run_dir: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Given: a short worker on the capture server, 12 prompts, greedy, capture on, and the
    # training folder to be built by the `captured` backend (float32, as the server runs)
    settings = configure_on(
        stack, vllm, model, "B1_cap", [(f"s{i}", f"Say hello number {i}") for i in range(12)],
        capture_states=True, output_dir=str(run_dir), model_path=str(model),
        sampling_params={"temperature": 0}, short_concurrency=4, short_max_tokens=40,
        read_timeout_s=600.0, extract_backend="captured", extract_dtype="float32",
        train_max_length=48, shard_samples=6, aux_layer_ids=list(AUX),
        cap_to_window=False)  # responses past the window: the connector's cut at 48
    stack.worker("short")
    stack.wait_workers(1)

    # When: `datagen run` generates, then prepare and extract build the folder
    run_s = datagen_run(stack)
    recs = list(iter_records(records_dir(settings.output_dir, "B1_cap")))
    assert sorted(r["id"] for r in recs) == sorted(f"s{i}" for i in range(12))
    for rec in recs:  # every counted sample names its checked file and has its logprobs
        assert len(unpack_logprobs(rec["output_logprobs"])) == len(rec["output_ids"])
        path = run_dir / rec["states"]
        # the positions inside the window only: the connector copied none past 48
        ids = rec["prompt_ids"] + rec["output_ids"][:-1]
        assert capture.check_file(path, ids[:48]) == rec["states_bytes"]
        assert path.name == f"{rec['rid']}.safetensors"
    # (responses ran past the window, which the files cut)
    assert any(len(r["prompt_ids"]) + len(r["output_ids"]) - 1 > 48 for r in recs)
    assert not list((run_dir / "states" / "B1_cap").glob("*.lock"))  # the workers removed them
    ledger = Ledger.from_settings(settings)
    # budget_counts = "trainable": each sample counted with its tokens inside the window
    assert ledger.snapshot("B1_cap")["tokens"] == sum(r["trainable_tokens"] for r in recs)
    assert sum(r["trainable_tokens"] for r in recs) < sum(r["completion_tokens"] for r in recs)
    # a lost attempt's file (no record names it, nothing in flight) in the states folder
    orphan = run_dir / "states" / "B1_cap" / "orphan.safetensors"
    orphan.write_bytes(b"not states")

    assert datagen(monkeypatch, stack, "prepare") == 0
    # prepare deleted it, and only it
    assert "B1_cap: deleted 1 captured state files of lost attempts" in capsys.readouterr().out
    assert not orphan.exists()
    assert sorted(p.name for p in (run_dir / "states" / "B1_cap").iterdir()) == sorted(
        f"{r['rid']}.safetensors" for r in recs)
    # the captured files, read before the build frees them (keep_captured_states off)
    # (copied: load_file maps the file, and freeing cuts it)
    captured_by_id = {r["id"]: {k: v.clone() for k, v in load(run_dir / r["states"]).items()}
                      for r in recs}
    stack.worker("gpu")
    stack.wait_workers(2)
    started = time.monotonic()
    assert datagen(monkeypatch, stack, "extract", "--interval", "0.5", "--timeout-s",
                   "600") == 0
    build_s = time.monotonic() - started
    printed = capsys.readouterr().out
    assert "specforge train --config" in printed

    # Then: SpecForge's folder, written from the captured files alone, each checked against
    # the server's logprobs (check_states is on by default) at 32 positions at most (a CPU)
    folder = extraction_dir(settings)
    checked = [json.loads(x) for m in (folder / "manifest").glob("*.jsonl")
               for x in m.read_text().splitlines()]
    assert len(checked) == 12 and all(0 < e["checked"] <= 32 for e in checked)
    worst_gap = max(e["gap"] for e in checked)
    assert worst_gap < 0.01
    print(f"FIGURE capture run: state check worst gap {worst_gap:.2e} nats (float32)")
    meta = json.loads((folder / "extraction.json").read_text())
    assert meta["backend"] == "captured" and meta["aux_layer_ids"] == list(AUX)
    # the gpu process's first sample at least was re-captured on the server (recapture_share
    # 0.01 by default) and found alike, which `datagen status` says
    assert any(e.get("recaptured") for e in checked)
    total = meta["state_check"]
    assert total["recaptured"] >= 1 and total["recapture_failed"] == 0, total
    assert datagen(monkeypatch, stack, "status") == 0
    assert "re-captured on the server, all alike" in capsys.readouterr().out
    for name in ("vocab_mapping.pt", "draft_config.json", "specforge_train.json"):
        assert (folder / name).is_file(), name
    by_id = {r["id"]: r for r in recs}
    shards = [run_dir / s["path"] for s in read_manifest(training_dir(run_dir))["shards"]]
    lines = [json.loads(x) for s in shards for x in s.read_text().splitlines()]
    files = sorted(folder.rglob("data_*.ckpt"))
    assert len(files) == len(lines) == 12
    for line in lines:
        rec = by_id[line["id"]]
        got = torch.load(folder / f"rows_0-2000/data_{line['idx']}.ckpt", weights_only=True)
        captured = captured_by_id[line["id"]]
        # freed once its row was written: only its mark, naming the row, is left
        assert not (run_dir / rec["states"]).exists()
        assert capture.built_row(run_dir / rec["states"]) == \
            f"rows_0-2000/data_{line['idx']}.ckpt"
        kept = min(48, len(rec["prompt_ids"]) + len(rec["output_ids"]) - 1)
        assert got["input_ids"].tolist() == captured["input_ids"][:kept].tolist()
        assert got["loss_mask"].tolist() == [0] * len(rec["prompt_ids"]) + [1] * (
            kept - len(rec["prompt_ids"]))
        assert torch.equal(got["aux_hidden_state"][0], captured["aux_hidden_state"][:kept])
        assert torch.equal(got["hidden_state"][0], captured["hidden_state"][:kept])
    print(f"FIGURE capture run: datagen run {run_s:.1f} s for 12 samples, the folder built "
          f"in {build_s:.1f} s with no forward pass")

    # And: a separate `vllm` backend extraction of the same records (one id shorter, as
    # captured: the last output id was never an input) gives the same files within bf16
    # rounding; measured in float32
    vllm.stop()
    same = [dict(line, output_ids=by_id[line["id"]]["output_ids"][:-1],
                 output_logprobs=pack_logprobs(unpack_logprobs(line["output_logprobs"])[:-1]))
            for line in lines]
    for line in same:
        line.pop("states", None)
    shard = write_jsonl(stack.tmp / "same.jsonl", same)
    cfg = ExtractionConfig(model_path=str(model), output_dir=str(stack.tmp / "vllm"),
                           aux_layer_ids=AUX, dtype="float32", device="cpu", max_length=48,
                           backend="vllm",
                           engine=EngineOptions(python=vllm_python(), args="--enforce-eager"))
    with Extractor(cfg) as ex:
        result = ex.run_shard(shard)
    # the engine's own files pass the same check (against the generation server's logprobs)
    assert result.written == 12 and result.check.checked == 12 and not result.check.failed
    worst = {"aux_hidden_state": 0.0, "hidden_state": 0.0}
    worst_rel = dict(worst)
    for line in lines:
        rel = f"rows_0-2000/data_{line['idx']}.ckpt"
        got = torch.load(folder / rel, weights_only=True)
        want = torch.load(stack.tmp / "vllm" / rel, weights_only=True)
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["loss_mask"], want["loss_mask"])
        for key in worst:
            assert got[key].shape == want[key].shape
            diff = (got[key] - want[key]).abs()
            worst[key] = max(worst[key], float(diff.max()))
            worst_rel[key] = max(worst_rel[key],
                                 float((diff / want[key].abs().clamp_min(1e-3)).max()))
            torch.testing.assert_close(got[key], want[key], rtol=BF16_RTOL, atol=1e-4)
    print(f"FIGURE captured vs vllm backend (float32): max |diff| {worst}, max relative "
          f"(|x| >= 1e-3) {worst_rel}")
