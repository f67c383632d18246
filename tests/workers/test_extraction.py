"""Extraction engine on a tiny random Llama (CPU, float32 unless said otherwise)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import manifest_idxs

from datagen.builders.tiny_model import build_tiny_llama
from datagen.errors import BadInput
from datagen.extraction.estimate import InsufficientDiskSpace
from datagen.extraction.extractor import ExtractionConfig, Extractor
from datagen.extraction.files import TMP_MARK
from datagen.extraction.manifest import load_done

VOCAB = 300
HIDDEN = 64
LAYERS = 8  # default aux ids [1, 3, 4]: three distinct layers
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("model"), VOCAB, hidden_size=HIDDEN,
                            num_layers=LAYERS)


@pytest.fixture(scope="module")
def model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_extractor(model, out: Path, **overrides) -> Extractor:
    kwargs = dict(model_path="", output_dir=str(out), dtype="float32", device="cpu",
                  batch_tokens=256, pack_tokens=128, writer_threads=2, max_pending_writes=3)
    kwargs.update(overrides)
    return Extractor.from_model(model, ExtractionConfig(**kwargs))


@pytest.fixture
def extractor(model, tmp_path: Path):
    ex = make_extractor(model, tmp_path / "out")
    yield ex
    ex.close()


def rand_ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def write_shard(path: Path, n: int, seed: int = 0, start: int = 0,
                lengths: tuple[int, int] = (5, 60)) -> list[dict]:
    rng = random.Random(seed)
    recs = [{"idx": start + i, "id": f"weird/../id {i}\n", "dataset": "B1",
             "prompt_ids": rand_ids(rng.randint(1, 20), rng),
             "output_ids": rand_ids(rng.randint(*lengths), rng)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return recs


def data_files(out: Path) -> list[Path]:
    return sorted(out.rglob("data_*.ckpt"))


def reference(model, ids: list[int]):
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states


# -- states ------------------------------------------------------------------------------

def test_aux_states_are_outputs_of_aux_layers_and_final_is_post_norm(model, extractor):
    ids = rand_ids(37, random.Random(1))
    hs = reference(model, ids)
    aux, final = extractor.forward_states([ids])[0]

    assert extractor.aux_layer_ids == (1, 3, 4)
    want_aux = torch.cat([hs[i + 1] for i in extractor.aux_layer_ids], dim=-1)
    torch.testing.assert_close(aux, want_aux, atol=1e-5, rtol=1e-5)
    # HF's hidden_states[-1] is the post-norm state (it replaces the last layer's output) ...
    torch.testing.assert_close(final, hs[-1], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        base = model.model(torch.tensor([ids]), use_cache=False).last_hidden_state
    torch.testing.assert_close(final, base, atol=1e-5, rtol=1e-5)
    # ... so it is not the raw output of the last decoder layer
    last_layer_out = []
    handle = model.model.layers[-1].register_forward_hook(
        lambda _m, _a, o: last_layer_out.append(o[0] if isinstance(o, tuple) else o))
    reference(model, ids)
    handle.remove()
    assert not torch.allclose(final, last_layer_out[0], atol=1e-3)


def test_packed_samples_equal_one_by_one(model, tmp_path):
    rng = random.Random(2)
    samples = [rand_ids(n, rng) for n in (40, 3, 17, 29, 1, 50)]
    with make_extractor(model, tmp_path, pack_tokens=4096) as ex:
        assert ex.pack_tokens == 4096  # the isolation check passed
        assert len(ex._rows([len(s) for s in samples])) == 1  # really one packed row
        packed = ex.forward_states(samples)
    for ids, (aux, final) in zip(samples, packed, strict=True):
        hs = reference(model, ids)
        torch.testing.assert_close(aux, torch.cat([hs[i + 1] for i in (1, 3, 4)], -1),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final, hs[-1], atol=1e-5, rtol=1e-5)


def test_bfloat16_run_within_bf16_tolerance(model, model_dir, tmp_path):
    ids = rand_ids(48, random.Random(3))
    hs = reference(model, ids)
    cfg = ExtractionConfig(model_path=str(model_dir), output_dir=str(tmp_path), device="cpu")
    with Extractor(cfg) as ex:  # loads from disk in bf16
        aux, final = ex.forward_states([ids])[0]
    assert aux.dtype == final.dtype == torch.bfloat16
    want = torch.cat([hs[i + 1] for i in (1, 3, 4)], -1)
    for got, ref in ((aux, want), (final, hs[-1])):
        rel = (got.float() - ref).abs().mean() / ref.abs().mean()
        assert rel < 2e-2


# -- files -------------------------------------------------------------------------------

def test_written_files_satisfy_specforge_contract(model, extractor, tmp_path):
    recs = write_shard(tmp_path / "shard.jsonl", 7, lengths=(1, 90))
    res = extractor.run_shard(tmp_path / "shard.jsonl")

    assert (res.written, res.skipped_done, res.failures) == (7, 0, [])
    out = Path(extractor.cfg.output_dir)
    files = data_files(out)
    assert [f.parent.name for f in files] == ["rows_0-2000"] * 7
    for rec in recs:
        d = torch.load(out / "rows_0-2000" / f"data_{rec['idx']}.ckpt", weights_only=True)
        ids = rec["prompt_ids"] + rec["output_ids"]
        n, n_prompt = len(ids), len(rec["prompt_ids"])
        assert set(d) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        assert d["input_ids"].dtype == d["loss_mask"].dtype == torch.int64
        assert d["input_ids"].tolist() == ids
        assert d["loss_mask"].tolist() == [0] * n_prompt + [1] * (n - n_prompt)
        assert d["aux_hidden_state"].shape == (1, n, 3 * HIDDEN)
        assert d["hidden_state"].shape == (1, n, HIDDEN)
        assert all(t.is_contiguous() and t.device.type == "cpu" for t in d.values())
        # each tensor owns exactly its bytes (a view would drag the whole batch buffer along)
        assert d["aux_hidden_state"].untyped_storage().nbytes() == n * 3 * HIDDEN * 4
        hs = reference(extractor.model, ids)
        torch.testing.assert_close(d["hidden_state"], hs[-1], atol=1e-5, rtol=1e-5)
    entries = [json.loads(x) for f in (out / "manifest").glob("*.jsonl")
               for x in f.read_text().splitlines()]
    assert sorted(e["idx"] for e in entries) == list(range(7))
    assert res.tokens == sum(e["tokens"] for e in entries)


def test_rows_folders_of_2000(model, extractor, tmp_path):
    write_shard(tmp_path / "shard.jsonl", 2, start=3999)
    extractor.run_shard(tmp_path / "shard.jsonl")
    names = [str(p.relative_to(extractor.cfg.output_dir)) for p in
             data_files(Path(extractor.cfg.output_dir))]
    assert names == ["rows_2000-4000/data_3999.ckpt", "rows_4000-6000/data_4000.ckpt"]


# -- resume ------------------------------------------------------------------------------

def test_second_run_writes_nothing(extractor, tmp_path):
    write_shard(tmp_path / "shard.jsonl", 5)
    assert extractor.run_shard(tmp_path / "shard.jsonl").written == 5
    mtimes = [f.stat().st_mtime_ns for f in data_files(Path(extractor.cfg.output_dir))]
    again = extractor.run_shard(tmp_path / "shard.jsonl")
    assert (again.written, again.skipped_done) == (0, 5)
    assert mtimes == [f.stat().st_mtime_ns for f in data_files(Path(extractor.cfg.output_dir))]


def test_aux_layers_default_to_specforge_and_are_written_into_the_metadata(model, tmp_path):
    # Given: the default aux layers of an 8-layer model, [1, N//2-1, N-4]
    out = tmp_path / "out"
    write_shard(tmp_path / "shard.jsonl", 3)
    with make_extractor(model, out) as ex:
        assert ex.aux_layer_ids == (1, 3, 4)
        ex.run_shard(tmp_path / "shard.jsonl")
    meta = json.loads((out / "extraction.json").read_text())
    assert (meta["aux_layer_ids"], meta["num_layers"], meta["hidden_size"]) == ([1, 3, 4], 8, 64)
    assert (meta["backend"], meta["dtype"]) == ("hf", "float32")

    # When/Then: a worker with other aux layers may not write into the same folder
    write_shard(tmp_path / "more.jsonl", 5)  # 2 samples not done yet
    with make_extractor(model, out, aux_layer_ids=(2, 4, 5)) as ex, pytest.raises(
            BadInput, match=r"aux_layer_ids=\[1, 3, 4\] but this worker has "
                            r"aux_layer_ids=\[2, 4, 5\]"):
        ex.run_shard(tmp_path / "more.jsonl")


def test_leftover_temp_and_unrecorded_file_are_redone(extractor, tmp_path):
    # Given a finished shard
    write_shard(tmp_path / "shard.jsonl", 4)
    extractor.run_shard(tmp_path / "shard.jsonl")
    out = Path(extractor.cfg.output_dir)
    rows = out / "rows_0-2000"
    # When a crash is simulated: sample 2 renamed but never recorded (and garbage, to prove it
    # is rewritten), sample 3 recorded but its file lost, a half-written temp left for 1
    manifest = next((out / "manifest").glob("*.jsonl"))
    lines = [x for x in manifest.read_text().splitlines() if json.loads(x)["idx"] != 2]
    manifest.write_text("\n".join(lines) + "\n" + '{"idx": 9, "id": "torn')  # torn last line
    (rows / "data_2.ckpt").write_bytes(b"half")
    (rows / "data_3.ckpt").unlink()
    (rows / f".data_2.ckpt{TMP_MARK}999-1").write_bytes(b"garbage")
    (rows / f".data_77.ckpt{TMP_MARK}999-1").write_bytes(b"another worker's")
    res = extractor.run_shard(tmp_path / "shard.jsonl")
    # Then 2 and 3 are redone, our temp is gone, another sample's temp is left alone
    assert (res.written, res.skipped_done) == (2, 2)
    assert sorted(p.name for p in rows.iterdir() if TMP_MARK in p.name) == [
        f".data_77.ckpt{TMP_MARK}999-1"]
    for i in range(4):
        assert torch.load(rows / f"data_{i}.ckpt", weights_only=True)["input_ids"].numel() > 0
    assert len(load_done(out)) == 4


KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    from datagen.extraction.extractor import ExtractionConfig, Extractor
    cfg = ExtractionConfig(model_path=sys.argv[1], output_dir=sys.argv[2], dtype="float32",
                           device="cpu", batch_tokens=1, writer_threads=2, max_pending_writes=2)
    Extractor(cfg).run_shard(sys.argv[3], progress=lambda done, total: time.sleep(0.05))
""")


@pytest.mark.chaos
def test_sigkill_mid_shard_then_rerun_leaves_one_complete_file_each(model, model_dir, tmp_path):
    n = 40
    recs = write_shard(tmp_path / "shard.jsonl", n, seed=5, lengths=(100, 400))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(model_dir), str(out),
                             str(tmp_path / "shard.jsonl")], env=env)
    deadline = time.monotonic() + 60
    while len(load_done(out)) < 8 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "extraction finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 8 <= len(load_done(out)) < n

    with make_extractor(model, out) as ex:
        res = ex.run_shard(tmp_path / "shard.jsonl")
    assert res.failures == [] and res.written + res.skipped_done == n
    files = data_files(out)
    assert sorted(int(f.stem.split("_")[1]) for f in files) == list(range(n))
    for f, rec in zip(sorted(files, key=lambda f: int(f.stem[5:])), recs, strict=True):
        d = torch.load(f, weights_only=True)
        assert d["hidden_state"].shape[1] == len(rec["prompt_ids"]) + len(rec["output_ids"])
    assert not [p for p in out.rglob("*") if TMP_MARK in p.name]
    assert sorted(manifest_idxs(out)) == list(range(n))


# -- overlong and failures -----------------------------------------------------------------

def test_overlong_truncate_keeps_first_tokens_and_mask(model, tmp_path):
    rec = {"idx": 0, "id": "long", "dataset": "A1", "prompt_ids": list(range(10)),
           "output_ids": list(range(10, 40))}
    (tmp_path / "s.jsonl").write_text(json.dumps(rec) + "\n")
    with make_extractor(model, tmp_path / "out", max_length=25) as ex:
        res = ex.run_shard(tmp_path / "s.jsonl")
    assert (res.written, res.truncated, res.skipped_overlong) == (1, 1, 0)
    d = torch.load(tmp_path / "out/rows_0-2000/data_0.ckpt", weights_only=True)
    assert d["input_ids"].tolist() == list(range(25))
    assert d["loss_mask"].tolist() == [0] * 10 + [1] * 15
    assert d["aux_hidden_state"].shape == (1, 25, 3 * HIDDEN)


def test_overlong_skip_is_reported(model, tmp_path):
    recs = [{"idx": i, "id": f"x{i}", "dataset": "A1", "prompt_ids": [1] * 5,
             "output_ids": [2] * n} for i, n in enumerate((10, 30))]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    with make_extractor(model, tmp_path / "out", max_length=25, overlong="skip") as ex:
        res = ex.run_shard(tmp_path / "s.jsonl")
    assert (res.written, res.skipped_overlong, res.overlong_ids) == (1, 1, ["x1"])
    assert [f.name for f in data_files(tmp_path / "out")] == ["data_0.ckpt"]


def test_bad_samples_fail_alone(extractor, tmp_path):
    recs = write_shard(tmp_path / "s.jsonl", 4)
    recs[1]["output_ids"][0] = VOCAB  # out of vocab: would be a device-side assert on CUDA
    lines = [json.dumps(r) for r in recs] + ["{not json", json.dumps({"idx": 9, "id": "e"})]
    (tmp_path / "s.jsonl").write_text("\n".join(lines) + "\n")
    res = extractor.run_shard(tmp_path / "s.jsonl")
    assert res.written == 3
    assert sorted((f.idx, f.id) for f in res.failures if f.idx is not None) == [
        (1, recs[1]["id"]), (9, "e")]
    assert any(f.id == "line 5" for f in res.failures)


def test_failing_batch_is_split_down_to_the_bad_sample(extractor, tmp_path, monkeypatch):
    recs = write_shard(tmp_path / "s.jsonl", 6, lengths=(5, 20))
    poison = recs[4]["prompt_ids"] + recs[4]["output_ids"]
    real = extractor.runner.forward_row

    def forward_row(id_lists, out):
        if any(list(ids) == poison for ids in id_lists):
            raise torch.cuda.OutOfMemoryError("simulated OOM")
        real(id_lists, out)

    monkeypatch.setattr(extractor.runner, "forward_row", forward_row)
    res = extractor.run_shard(tmp_path / "s.jsonl")
    assert res.written == 5
    assert [(f.idx, "OutOfMemoryError" in f.reason) for f in res.failures] == [(4, True)]


def test_disk_check_refuses_unless_forced(model, tmp_path, monkeypatch):
    import datagen.extraction.estimate as est

    write_shard(tmp_path / "s.jsonl", 2)
    monkeypatch.setattr(est.shutil, "disk_usage", lambda _p: SimpleNamespace(free=10))
    with make_extractor(model, tmp_path / "out") as ex:
        with pytest.raises(InsufficientDiskSpace, match="--force"):
            ex.run_shard(tmp_path / "s.jsonl")
    with make_extractor(model, tmp_path / "out", force=True) as ex:
        assert ex.run_shard(tmp_path / "s.jsonl").written == 2


def test_measure_forward_reports_tokens_per_second(extractor):
    assert extractor.measure_forward(seq_len=64, n_batches=2) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pipeline_matches_cpu_files(model_dir, tmp_path):
    # pinned slots, copy stream and events only run on CUDA: compare their files with CPU's
    write_shard(tmp_path / "s.jsonl", 12, lengths=(50, 300))
    outs = {}
    for device in ("cpu", "cuda"):
        cfg = ExtractionConfig(model_path=str(model_dir), output_dir=str(tmp_path / device),
                               dtype="float32", device=device, batch_tokens=700,
                               max_pending_writes=2)
        with Extractor(cfg) as ex:
            assert ex.run_shard(tmp_path / "s.jsonl").written == 12
        outs[device] = {f.name: torch.load(f, weights_only=True)
                        for f in data_files(tmp_path / device)}
    assert outs["cpu"].keys() == outs["cuda"].keys()
    for name, want in outs["cpu"].items():
        for key, t in outs["cuda"][name].items():
            torch.testing.assert_close(t, want[key], atol=1e-4, rtol=1e-4)


def test_disk_error_fails_the_shard_and_a_retry_redoes_only_the_lost_sample(
        extractor, tmp_path, monkeypatch):
    import errno

    import datagen.extraction.extractor as extraction
    from datagen.errors import StorageError

    write_shard(tmp_path / "s.jsonl", 5)
    real = extraction.save_atomic

    def save_atomic(final, tensors):
        if final.name == "data_2.ckpt":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(final, tensors)

    monkeypatch.setattr(extraction, "save_atomic", save_atomic)
    with pytest.raises(StorageError, match="No space left"):
        extractor.run_shard(tmp_path / "s.jsonl")
    monkeypatch.setattr(extraction, "save_atomic", real)
    res = extractor.run_shard(tmp_path / "s.jsonl")
    assert (res.written, res.skipped_done) == (1, 4)
