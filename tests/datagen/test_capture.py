"""capture_states without a server: the file check, the lock wait, the settings, the server's
arguments, the worker's wait, the shard rule and the `captured` backend (the real vLLM server:
tests/real_vllm/test_capture_vllm.py)."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Stack, wait_until, write_jsonl
from safetensors.torch import save_file

from config.settings import Settings, SettingsError
from datagen.errors import CaptureFailed, ServerUnavailable
from datagen.extraction.extractor import ExtractionConfig, Extractor
from datagen.extraction.files import Rejected, prepare
from datagen.extraction.manifest import shard_name
from datagen.generation.job import Prompt
from datagen.generation.ledger import Ledger, connect
from datagen.generation.records import iter_records, records_dir
from datagen.generation.runner import await_states
from datagen.servers import capture
from datagen.servers.base import Generation

H, LAYERS, VOCAB = 8, 8, 100
AUX = [1, 3, 4]  # SpecForge's default for 8 layers


def write_states(path: Path, ids: list[int], seed: int = 0, aux_ids: list[int] = AUX) -> dict:
    g = torch.Generator().manual_seed(seed)
    tensors = {"input_ids": torch.tensor(ids, dtype=torch.int64),
               "aux_hidden_state": torch.randn(len(ids), 3 * H, generator=g),
               "hidden_state": torch.randn(len(ids), H, generator=g)}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), {"aux_layer_ids": json.dumps(aux_ids)})
    return tensors


def test_a_whole_file_of_the_samples_ids_passes_the_check(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    write_states(path, [5, 6, 7, 8])
    assert capture.check_file(path, [5, 6, 7, 8]) == path.stat().st_size


@pytest.mark.parametrize("damage,why", [
    ("other_ids", "token 2 is 7"), ("short", "bytes"), ("missing", "not written"),
    ("fewer", "expected 5 positions")])
def test_a_file_that_is_not_the_samples_states_is_refused(tmp_path: Path, damage: str,
                                                          why: str) -> None:
    path = tmp_path / "a.safetensors"
    write_states(path, [5, 6, 7, 8])
    ids = [5, 6, 9, 8]
    if damage == "other_ids":
        pass
    elif damage == "short":  # killed mid-write without the atomic rename: a torn file
        ids = [5, 6, 7, 8]
        with open(path, "r+b") as fh:
            fh.truncate(path.stat().st_size - 3)
    elif damage == "missing":
        path.unlink()
    else:
        ids = [5, 6, 7, 8, 9]
    with pytest.raises(capture.CaptureMismatch, match=why):
        capture.check_file(path, ids)


@pytest.mark.parametrize("garbage", [b"\x01\x00", b"\x05" + b"\x00" * 7 + b"{not!",
                                     b"\x02" + b"\x00" * 7 + b"[]"])
def test_a_file_that_is_not_safetensors_is_a_mismatch_not_a_crash(tmp_path: Path,
                                                                  garbage: bytes) -> None:
    path = tmp_path / "a.safetensors"
    path.write_bytes(garbage)
    with pytest.raises(capture.CaptureMismatch):
        capture.check_file(path, [1, 2])


def test_a_file_captured_at_other_aux_layers_is_refused_before_the_sample_counts(
        tmp_path: Path) -> None:
    # Given: a file the server captured at AUX, and a run whose settings name other layers
    settings = Settings(output_dir=str(tmp_path), capture_states=True, server_kind="vllm",
                        capture_timeout_s=0.05, aux_layer_ids=[1, 2, 3])
    path = capture.states_path(tmp_path, "B1", "r1")
    write_states(path, [1, 2, 3, 40, 41])

    # When / Then: the worker's check refuses it (retryable: never counted)
    assert capture.check_file(path, [1, 2, 3, 40, 41], AUX) == path.stat().st_size
    with pytest.raises(CaptureFailed, match=r"aux layers \[1, 3, 4\], the run's are \[1, 2, 3\]"):
        await_states(settings, path, Prompt("s", "B1", [], [1, 2, 3]), gen([40, 41, 42]))


@pytest.mark.parametrize("setting,why", [
    ({"async_scheduling": True}, "async scheduling with the V1 model runner"),
    ({"prefix_caching": True}, "prefix caching is on"),
    ({"dtype": "float16", "model_types": ["kimi_k25", "deepseek_v3"]}, "float16 on a DeepSeek"),
])
def test_a_capture_server_refuses_settings_under_which_its_states_are_wrong(
        setting: dict, why: str) -> None:
    fine = {"async_scheduling": False, "v2_runner": False, "prefix_caching": False,
            "dtype": "bfloat16", "model_types": ["kimi_k25", "deepseek_v3"]}
    assert capture.engine_refusal(**fine) is None
    assert why in (capture.engine_refusal(**{**fine, **setting}) or "")
    # the V2 runner takes async scheduling; float16 is fine for other models
    assert capture.engine_refusal(**{**fine, "async_scheduling": True, "v2_runner": True}) is None
    assert capture.engine_refusal(**{**fine, "dtype": "float16", "model_types": ["llama"]}) is None


def test_capture_refuses_several_samples_per_request() -> None:
    with pytest.raises(SettingsError, match="sampling_params.n = 2 with capture_states"):
        Settings(capture_states=True, server_kind="vllm", sampling_params={"n": 2})


def test_the_wait_ends_when_the_servers_lock_is_released(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    held = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(held, fcntl.LOCK_EX)  # the connector holds it from before the answer
    assert not capture.wait_released(path, 0.05)
    os.close(held)  # the write ended
    assert capture.wait_released(path, 0.05)
    assert capture.wait_released(tmp_path / "never.safetensors", 0.05)


def test_files_are_named_by_the_attempts_rid_under_the_runs_states_folder(tmp_path: Path
                                                                          ) -> None:
    a, b = (capture.states_path(tmp_path, "B1", rid) for rid in ("r1", "r2"))
    assert a == tmp_path.resolve() / "states" / "B1" / "r1.safetensors" and a != b
    assert capture.request_params(a) == {"hidden_states_path": str(a),
                                         "include_output_tokens": True}
    # with the window, the connector writes its positions only
    assert capture.request_params(a, 2048) == {"hidden_states_path": str(a),
                                               "include_output_tokens": True,
                                               "keep_positions": 2048}


def test_capture_needs_a_vllm_server_and_says_so() -> None:
    with pytest.raises(SettingsError, match="capture_states: true needs server_kind = 'vllm'"):
        Settings(capture_states=True)
    with pytest.raises(SettingsError, match="server_kind is 'auto'"):
        Settings(capture_states=True, server_kind="auto")
    with pytest.raises(SettingsError, match="regenerate = 'all'"):
        Settings(capture_states=True, server_kind="vllm", regenerate="all")
    assert Settings(capture_states=True, server_kind="vllm").capture_states


def test_server_args_capture_the_aux_layers_and_the_last_one_under_states(tmp_path: Path
                                                                          ) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": LAYERS}))
    args = capture.server_args(str(tmp_path), tmp_path / "run", "float32")
    spec = json.loads(args[args.index("--speculative-config") + 1])
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [
        2, 4, 5, 8]
    extra = kv["kv_connector_extra_config"]
    assert (kv["kv_connector"], kv["kv_connector_module_path"]) == (
        "CaptureConnector", "datagen.extraction.vllm_connector")
    assert extra["shared_storage_path"] == str((tmp_path / "run" / "states").resolve())
    assert extra["slots"] == [0, 1, 2, 3] and extra["dtype"] == "float32"


def test_a_kimi_k25_capture_server_is_launched_text_only(tmp_path: Path) -> None:
    # Given: a folder laid out as Kimi-K2.5's (a vision tower beside the text model)
    from cli.vllm import launch_argv
    from datagen.builders.tiny_kimi import build_tiny_kimi_k25

    folder = build_tiny_kimi_k25(tmp_path / "kimi", 512, hidden_size=128, num_layers=8)

    # When: the capture server's command line is made
    argv = launch_argv(folder, 8000, 256, "bfloat16",
                       capture.server_args(str(folder), tmp_path / "run", "bfloat16"))

    # Then: no media of any kind (vLLM builds no vision tower and no multimodal processor,
    # which --skip-tokenizer-init rules out); the operator's own setting is left alone; a
    # text model gets nothing
    limit = argv[argv.index("--limit-mm-per-prompt") + 1]
    assert json.loads(limit) == {"image": 0, "video": 0, "vision_chunk": 0}
    assert "--skip-tokenizer-init" in argv
    assert capture.text_only(str(folder), ["--limit-mm-per-prompt={\"image\": 1}"]) == []
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": LAYERS}))
    assert "--limit-mm-per-prompt" not in capture.server_args(str(tmp_path), tmp_path, "bf16")


def gen(output_ids: list[int]) -> Generation:
    return Generation(output_ids, {"type": "length"}, 3, len(output_ids), 0.1, "")


def test_the_worker_names_a_checked_file_and_a_late_or_wrong_one_is_retryable(
        tmp_path: Path) -> None:
    settings = Settings(output_dir=str(tmp_path), capture_states=True, server_kind="vllm",
                        capture_timeout_s=0.05)
    prompt = Prompt("s", "B1", [], [1, 2, 3])
    path = capture.states_path(tmp_path, "B1", "r1")
    write_states(path, [1, 2, 3, 40, 41])  # prompt + output minus its last id
    Path(f"{path}.lock").touch()
    got = await_states(settings, path, prompt, gen([40, 41, 42]))
    assert got == {"states": "states/B1/r1.safetensors", "states_bytes": path.stat().st_size}
    assert not Path(f"{path}.lock").exists()
    with pytest.raises(CaptureFailed, match="token 4 is 41") as err:
        await_states(settings, path, prompt, gen([40, 43, 42]))
    assert isinstance(err.value, ServerUnavailable)  # run_job retries it as a server fault
    held = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        with pytest.raises(CaptureFailed, match="still locked"):
            await_states(settings, path, prompt, gen([40, 41, 42]))
    finally:
        os.close(held)


def test_a_captured_sample_ends_one_id_earlier_and_needs_its_file() -> None:
    rec = {"idx": 0, "id": "s", "dataset": "B1", "prompt_ids": [1, 2], "output_ids": [3, 4, 5],
           "states": "/x.safetensors"}
    s = prepare(1, rec, 2048, "truncate", VOCAB, captured=True)
    assert s.input_ids == [1, 2, 3, 4] and s.n_prompt == 2 and s.states == "/x.safetensors"
    assert prepare(1, rec, 2048, "truncate", VOCAB).input_ids == [1, 2, 3, 4, 5]
    del rec["states"]
    assert isinstance(prepare(1, rec, 2048, "truncate", VOCAB, captured=True), Rejected)


def test_the_captured_backend_writes_specforge_files_from_the_captured_states(
        tmp_path: Path) -> None:
    # Given: two records with captured files, one longer than train_max_length
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"hidden_size": H, "num_hidden_layers": LAYERS, "vocab_size": VOCAB}))
    recs, states = [], {}
    for idx, (n_prompt, n_out) in enumerate([(3, 6), (4, 20)]):
        prompt, out = list(range(10, 10 + n_prompt)), list(range(50, 50 + n_out))
        path = tmp_path / "run" / "states" / f"r{idx}.safetensors"
        states[idx] = write_states(path, prompt + out[:-1], seed=idx)
        recs.append({"idx": idx, "id": f"s{idx}", "dataset": "B1", "prompt_ids": prompt,
                     "output_ids": out, "states": str(path)})
    shard = write_jsonl(tmp_path / "shard.jsonl", recs)
    cfg = ExtractionConfig(model_path=str(model), output_dir=str(tmp_path / "hs"),
                           dtype="bfloat16", device="cpu", max_length=16, backend="captured")

    # When: the shard is extracted with the captured backend
    with Extractor(cfg) as ex:
        result = ex.run_shard(shard)

    # Then: each file is its captured states, cut at 16, in bf16, with the record's loss mask
    assert result.written == 2 and not result.failures and result.truncated == 1
    for idx, n_prompt, kept in ((0, 3, 8), (1, 4, 16)):
        got = torch.load(tmp_path / "hs" / f"rows_0-2000/data_{idx}.ckpt", weights_only=True)
        assert got["input_ids"].tolist() == states[idx]["input_ids"][:kept].tolist()
        assert got["loss_mask"].tolist() == [0] * n_prompt + [1] * (kept - n_prompt)
        for key in ("aux_hidden_state", "hidden_state"):
            assert got[key].dtype == torch.bfloat16 and got[key].shape[:2] == (1, kept)
            assert torch.equal(got[key][0], states[idx][key][:kept].to(torch.bfloat16))


EOS = 99


def captured_shard(tmp_path: Path, lengths: list[tuple[int, int]]) -> tuple[Path, Path]:
    """(model folder, shard) of samples whose output ends in EOS, each with its file."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(
        {"hidden_size": H, "num_hidden_layers": LAYERS, "vocab_size": VOCAB}))
    recs = []
    for idx, (n_prompt, n_out) in enumerate(lengths):
        prompt, out = list(range(10, 10 + n_prompt)), [*range(50, 49 + n_out), EOS]
        path = tmp_path / "run" / "states" / f"r{idx}.safetensors"
        write_states(path, prompt + out[:-1], seed=idx)
        recs.append({"idx": idx, "id": f"s{idx}", "dataset": "B1", "prompt_ids": prompt,
                     "output_ids": out, "states": str(path)})
    return model, write_jsonl(tmp_path / "shard.jsonl", recs)


def test_the_stop_token_is_counted_for_the_draft_vocab_as_in_an_hf_row(tmp_path: Path
                                                                       ) -> None:
    # Given: 5 captured samples whose outputs end in EOS (never an input: not in the file),
    # the last one longer than train_max_length
    from datagen.training import vocab_mapping as vm

    model, shard = captured_shard(tmp_path, [(3, 4)] * 4 + [(4, 20)])
    cfg = ExtractionConfig(model_path=str(model), output_dir=str(tmp_path / "hs"),
                           dtype="float32", device="cpu", max_length=16, backend="captured")

    # When: the shard is extracted
    with Extractor(cfg) as ex:
        assert ex.run_shard(shard).written == 5
    counts, _ = vm.read_shard_counts(tmp_path / "hs" / vm.COUNTS_DIR /
                                     f"{shard_name(shard)}.json")

    # Then: EOS counts once per sample whose hf row keeps it (the cut one's does not), and
    # every other id as the hf rows count it
    assert counts[EOS][0] == 4
    assert counts[50][0] == 5 and counts[52][0] == 5 and 10 not in counts


def test_specforge_trains_the_stop_tokens_prediction_in_a_captured_row_too() -> None:
    # Given: one sample's hf row (prompt 3, output 4 ending in EOS) and its captured row (one
    # position fewer), with final states numbered by position
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.utils import padding

    ids = [10, 11, 12, 50, 51, 52, EOS]
    def row(n: int) -> dict:
        return {"input_ids": torch.tensor(ids[:n]), "loss_mask": torch.tensor(
            [0, 0, 0] + [1] * (n - 3)), "aux_hidden_state": torch.zeros(1, n, 3 * H),
            "hidden_state": torch.arange(n, dtype=torch.float32)[None, :, None].expand(
                1, n, H)}

    # When: SpecForge's offline normalizer and its target head's shift run on each
    def trained(n: int) -> list[int]:
        t = normalize_offline_sample(row(n), 2048)
        target = padding(t["target"], left=False)  # TargetHead.preprocess
        return [int(target[0, i, 0]) for i in range(n) if t["loss_mask"][0, i]]

    # Then: the trained targets are the final states at positions 4..6 (hf) and 4..5
    # (captured): the state at position 5 (its lm_head predicts EOS, position 6) in both;
    # only the hf row's state at EOS itself (what follows a stop) is not in the captured row
    assert trained(7) == [4, 5, 6]
    assert trained(6) == [4, 5]


def test_a_file_cut_at_the_window_builds_its_row_and_a_longer_window_is_refused_saying_why(
        tmp_path: Path) -> None:
    # Given: a sample whose response ran past the window (16) with cap_to_window off: the
    # server kept its first 16 positions only (keep_positions)
    model, shard = captured_shard(tmp_path, [(4, 20)])
    rec = json.loads(shard.read_text())
    write_states(Path(rec["states"]), (rec["prompt_ids"] + rec["output_ids"][:-1])[:16], seed=0)

    # When: it is built at the same window, then at a longer one
    with Extractor(ExtractionConfig(model_path=str(model), output_dir=str(tmp_path / "hs"),
                                    dtype="float32", device="cpu", max_length=16,
                                    backend="captured", keep_captured_states=True)) as ex:
        same = ex.run_shard(shard)
    with Extractor(ExtractionConfig(model_path=str(model), output_dir=str(tmp_path / "hs2"),
                                    dtype="float32", device="cpu", max_length=24,
                                    backend="captured")) as ex:
        longer = ex.run_shard(shard)

    # Then: the same window gives its row; the longer one fails the sample, saying why
    assert same.written == 1
    row = torch.load(tmp_path / "hs" / "rows_0-2000" / "data_0.ckpt", weights_only=True)
    assert row["input_ids"].numel() == 16
    assert longer.written == 0 and len(longer.failures) == 1
    assert "16 positions captured, the row needs 23" in longer.failures[0].reason
    assert "extracted again" in longer.failures[0].reason


def captured_records(run: Path, n: int) -> None:
    """``n`` committed records of dataset B1 under ``run``, each naming its captured file."""
    recs = []
    for i in range(n):
        rel = f"states/B1/r{i}.safetensors"
        write_states(run / rel, [1, 2, 3, 40 + i, 41, 42], seed=i)
        recs.append({"v": 1, "id": f"s{i}", "dataset": "B1", "rid": f"r{i}", "messages": [],
                     "prompt_ids": [1, 2, 3], "output_ids": [40 + i, 41, 42, EOS],
                     "prompt_tokens": 3, "completion_tokens": 4, "truncated": False,
                     "time": 1.0 + i, "states": rel, "states_bytes": 1})
    write_jsonl(run / "records" / "B1" / "h-1.jsonl", recs)


def test_shards_name_states_under_the_run_folder_wherever_a_worker_mounts_it(
        tmp_path: Path) -> None:
    # Given: a run whose records name their captured states (relative to output_dir)
    from datagen.training.training_set import prepare as prepare_set
    from datagen.training.training_set import read_manifest, training_dir

    run = tmp_path / "host-a" / "run"
    captured_records(run, 3)
    prepare_set(Settings(output_dir=str(run), shard_samples=4), {}, None)
    shard = run / read_manifest(training_dir(run))["shards"][0]["path"]

    # When: a gpu worker that mounts the shared folder elsewhere extracts the shard
    moved = tmp_path / "host-b" / "mnt"
    moved.parent.mkdir()
    run.rename(moved)
    model, _ = captured_shard(tmp_path, [])
    cfg = ExtractionConfig(model_path=str(model), output_dir=str(tmp_path / "hs"),
                           dtype="float32", device="cpu", backend="captured",
                           run_dir=str(moved))
    lines = [json.loads(x) for x in (moved / shard.relative_to(run)).read_text().splitlines()]
    with Extractor(cfg) as ex:
        result = ex.run_shard(moved / shard.relative_to(run))

    # Then: the shard names each file relative to the run folder, and the worker finds them
    assert sorted(x["states"] for x in lines) == [f"states/B1/r{i}.safetensors" for i in range(3)]
    assert result.written == 3 and not result.failures


def test_the_captured_backend_refuses_states_of_other_aux_layers(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"hidden_size": H, "num_hidden_layers": LAYERS, "vocab_size": VOCAB}))
    path = tmp_path / "s.safetensors"
    write_states(path, [1, 2, 3, 4], aux_ids=[1, 2, 3])
    shard = write_jsonl(tmp_path / "shard.jsonl", [{
        "idx": 0, "id": "s0", "dataset": "B1", "prompt_ids": [1, 2], "output_ids": [3, 4, 5],
        "states": str(path)}])
    cfg = ExtractionConfig(model_path=str(model), output_dir=str(tmp_path / "hs"),
                           dtype="float32", device="cpu", backend="captured")
    with Extractor(cfg) as ex:
        result = ex.run_shard(shard)
    assert result.written == 0
    assert "captured at aux layers [1, 2, 3]" in result.failures[0].reason


def test_a_server_that_writes_no_states_never_gets_a_sample_counted(stack: Stack) -> None:
    # Given: a worker with capture on against a vLLM-protocol server that answers but writes
    # no file (the simulator: it ignores kv_transfer_params), one retry
    from producers.producer import Producer

    stack.start_simulator("--kind", "vllm", "--lengths", "fixed:20", "--decode-step-s", "0.001")
    part = write_jsonl(stack.tmp / "partition" / "B1.jsonl",
                       [{"id": f"s{i}", "prompt": f"hello {i}"} for i in range(3)])
    settings = stack.configure(data_dir=str(part.parent), server_kind="vllm",
                               capture_states=True, capture_timeout_s=5.0, max_retries=1,
                               short_concurrency=3)
    stack.worker("short")
    stack.wait_workers(1)
    ledger = stack.ledger()

    # When: the samples run
    Producer(settings, stack.app(), ledger).run()
    wait_until(lambda: len(ledger.dead("B1")) == 3, 120, what="3 samples given up on")

    # Then: each was tried twice (a new rid each time), none stored or counted
    assert all("captured states" in why and "not written" in why
               for why in ledger.dead("B1").values())
    assert ledger.snapshot("B1")["tokens"] == 0
    assert not list(iter_records(records_dir(settings.output_dir, "B1")))
    starts = [e for e in stack.sim_log() if e["event"] == "start"]
    assert len(starts) == 6 and len({e["rid"] for e in starts}) == 6


def test_prune_deletes_only_the_files_of_lost_attempts(tmp_path: Path) -> None:
    # Given: a dataset's states folder with a counted attempt (file and lock), one in flight
    # (its write going on: lock held), a lost one (file, lock), the temporary of a write cut
    # by a killed server, and a lost attempt whose lock the connector still holds
    folder = tmp_path / capture.STATES_DIR / "B1"
    def made(rid: str, *names: str) -> None:
        for name in names:
            (folder / name.format(rid=rid)).write_bytes(b"x" * 10)
    folder.mkdir(parents=True)
    made("counted", "{rid}.safetensors", "{rid}.safetensors.lock")
    made("flying", "{rid}.safetensors.lock", ".{rid}.safetensors.tmp-1-2")
    made("lost", "{rid}.safetensors", "{rid}.safetensors.lock")
    made("cut", ".{rid}.safetensors.tmp-7-8")
    made("writing", "{rid}.safetensors.lock", ".{rid}.safetensors.tmp-3-4")
    (folder / "notes.txt").write_text("not an attempt's")
    held = os.open(folder / "writing.safetensors.lock", os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)
    asked = []

    # When: pruned, the rids to keep read after the listing
    def kept() -> set[str]:
        asked.append(sorted(p.name for p in folder.iterdir()))
        made("late", "{rid}.safetensors")  # an attempt that started after the listing
        return {"counted", "flying"}
    try:
        files, size = capture.prune(tmp_path, "B1", kept)
    finally:
        os.close(held)

    # Then: the lost attempt's file and lock and the cut write's temporary are gone; the
    # counted, the in-flight, the locked one, the late one and other files stay
    assert (files, size) == (3, 30) and len(asked) == 1
    assert sorted(p.name for p in folder.iterdir()) == sorted([
        "counted.safetensors", "counted.safetensors.lock", "flying.safetensors.lock",
        ".flying.safetensors.tmp-1-2", "writing.safetensors.lock",
        ".writing.safetensors.tmp-3-4", "late.safetensors", "notes.txt"])
    assert capture.prune(tmp_path, "B2", kept) == (0, 0)  # no folder: nothing to do
    assert [capture.attempt_rid(n) for n in ("a.safetensors", "a.safetensors.lock",
                                             ".a.safetensors.tmp-1-2", "notes.txt")] == [
        "a", "a", "a", None]


class ReadsThenCommits:
    """``ledger.r``'s hash reads, with ``commit`` run once right after the ``after``-th of
    them has ended (an HSCAN's when its last reply is in): an attempt that commits while
    prepare's prune reads which attempts to keep."""

    def __init__(self, ledger: Ledger, after: int, commit: Any):
        self.reads, self.after, self.commit = 0, after, commit
        real_hgetall, real_hscan = ledger.r.hgetall, ledger.r.hscan_iter
        ledger.r.hgetall = lambda *a, **k: self._ended(real_hgetall(*a, **k))  # type: ignore
        ledger.r.hscan_iter = lambda *a, **k: self._scan(real_hscan(*a, **k))  # type: ignore

    def _ended(self, value: Any) -> Any:
        self.reads += 1
        if self.reads == self.after:
            self.commit()
        return value

    def _scan(self, items: Any) -> Any:
        yield from items
        self._ended(None)


@pytest.mark.parametrize("after", [1, 2])
def test_prune_keeps_the_file_of_an_attempt_that_commits_while_it_reads_the_ledger(
        tmp_path: Path, redis_url: str, after: int) -> None:
    # Given: an attempt in flight whose file is written, and a lost one's file
    from cli.extraction import prune_lost_states

    settings = Settings(redis_url=redis_url, output_dir=str(tmp_path), capture_states=True,
                        server_kind="vllm", token_budget=1000)
    ledger = Ledger(connect(redis_url), settings)
    ledger.register(["B1"])
    ledger.mark_run()
    assert ledger.admit("B1", "s1", "r1", "w", 3, 100).status == "ok"
    for rid in ("r1", "lost"):
        write_states(capture.states_path(tmp_path, "B1", rid), [1, 2, 3])
    committed = []

    # When: the attempt commits right after the prune's first (or second) read of the ledger
    ReadsThenCommits(ledger, after, lambda: committed.append(
        ledger.commit("B1", "s1", "r1", 3, 10, False, 1.0)))
    prune_lost_states(ledger, ["B1"])

    # Then: it was counted, and its file is still there; the lost one's is gone
    assert committed and committed[0].committed
    assert capture.states_path(tmp_path, "B1", "r1").is_file()
    assert not capture.states_path(tmp_path, "B1", "lost").exists()


def test_a_captured_attempt_whose_lease_ended_is_never_counted(redis_url: str) -> None:
    # Given: two attempts whose in-flight entries went before their commits (reaped, or
    # released): prepare may have pruned their files since
    ledger = Ledger(connect(redis_url), Settings(redis_url=redis_url, token_budget=1000))
    ledger.register(["B1"])
    ledger.mark_run()
    for sample, rid in (("s1", "r1"), ("s2", "r2")):
        assert ledger.admit("B1", sample, rid, "w", 3, 100).status == "ok"
        ledger.release("B1", sample, rid)

    # When: each commits, one with its states captured, one without
    captured = ledger.commit("B1", "s1", "r1", 3, 10, False, 1.0, held=True)
    plain = ledger.commit("B1", "s2", "r2", 3, 10, False, 1.0)

    # Then: the captured one is refused and not counted; the other counts, as before
    assert captured.lapsed and not captured.committed
    assert plain.committed and not plain.lapsed
    assert ledger.committed("B1") == {"s2": "r2 10"}


# The connector's write (CaptureConnector._write_sample runs inside vLLM; vLLM is not in this
# environment): the lock taken before the answer, save_atomic with safetensors, the lock
# closed. Here the writer stops for good inside save_atomic, after its temporary is written
# and before the rename, until it is SIGKILLed: a server killed mid-write.
MID_WRITE = r"""
import fcntl, os, sys, time, torch
from pathlib import Path
from safetensors.torch import save_file
from datagen.extraction import files
path = Path(sys.argv[1])
lock = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY, 0o644)
fcntl.flock(lock, fcntl.LOCK_EX)
def stuck(_path, flags=os.O_RDONLY):
    print("written", flush=True)
    time.sleep(3600)
files._fsync = stuck
ids = torch.tensor([1, 2, 3, 40, 41], dtype=torch.int64)
files.save_atomic(path, {"input_ids": ids, "aux_hidden_state": torch.zeros(5, 24),
                         "hidden_state": torch.zeros(5, 8)},
                  save=lambda tensors, p: save_file(tensors, str(p)))
"""


def test_a_server_killed_mid_write_leaves_no_file_a_sample_could_be_counted_with(
        tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from cli.stack import REPO

    # Given: the server's writer stopped between its write and its rename
    path = capture.states_path(tmp_path, "B1", "r1")
    path.parent.mkdir(parents=True)
    child = subprocess.Popen([sys.executable, "-c", MID_WRITE, str(path)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "written"
        temps = [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}")]
        assert len(temps) == 1 and temps[0].stat().st_size > 0 and not path.exists()
        assert not capture.wait_released(path, 0.05)  # the write holds the lock
    finally:
        # When: it is killed
        child.send_signal(signal.SIGKILL)
        child.wait()

    # Then: the lock went with it, no file stands under the attempt's name, the worker's
    # wait ends in a retryable CaptureFailed (a new rid, a new file: never this one), and
    # prepare's prune deletes what the write left
    settings = Settings(output_dir=str(tmp_path), capture_states=True, server_kind="vllm",
                        capture_timeout_s=5.0)
    assert capture.wait_released(path, 5.0)
    with pytest.raises(CaptureFailed) as err:
        await_states(settings, path, Prompt("s", "B1", [], [1, 2, 3]), gen([40, 41, 42]))
    assert isinstance(err.value, ServerUnavailable)
    assert not path.exists()
    left = sorted(p.name for p in path.parent.iterdir())
    assert left == sorted([temps[0].name, f"{path.name}.lock"])
    size = temps[0].stat().st_size
    assert capture.prune(tmp_path, "B1", set) == (2, size)
    assert not list(path.parent.iterdir())


def test_a_worker_that_never_sees_the_server_s_files_gives_up_at_once(stack: Stack) -> None:
    # Given: a server that writes its states nowhere this worker looks (the simulator writes
    # no file and no lock: as a server mounting another folder), five retries per sample, and
    # capture_unseen_limit 3
    from producers.producer import Producer

    stack.start_simulator("--kind", "vllm", "--lengths", "fixed:20", "--decode-step-s", "0.001")
    part = write_jsonl(stack.tmp / "partition" / "B1.jsonl",
                       [{"id": f"s{i}", "prompt": f"hello {i}"} for i in range(6)])
    settings = stack.configure(data_dir=str(part.parent), server_kind="vllm",
                               capture_states=True, capture_timeout_s=5.0, max_retries=5,
                               short_concurrency=1, capture_unseen_limit=3)
    stack.worker("short")
    stack.wait_workers(1)
    ledger = stack.ledger()

    # When: the samples run
    Producer(settings, stack.app(), ledger).run()
    wait_until(lambda: len(ledger.dead("B1")) == 6, 120, what="6 samples given up on")

    # Then: after 3 files in a row with neither file nor lock, every sample is given up at its
    # first miss with the reason that names the folder, not re-run five times each (36 runs)
    reasons = list(ledger.dead("B1").values())
    assert sum("where this worker does not see them" in why for why in reasons) >= 5
    assert all(str(settings.output_dir) in why for why in reasons
               if "does not see them" in why)
    starts = [e for e in stack.sim_log() if e["event"] == "start"]
    assert len(starts) == 2 + 6, len(starts)  # two misses retried, then one run each
    assert ledger.snapshot("B1")["tokens"] == 0
