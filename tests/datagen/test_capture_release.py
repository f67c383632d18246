"""The `captured` build frees each captured file once its row is durable (keep_captured_states
off): never before its manifest line, resumed after a crash, refused with what to do when a
later build needs it, and the record still counted by merge and prepare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_capture import captured_records, captured_shard

from config.settings import Settings
from datagen.extraction.extractor import ExtractionConfig, Extractor
from datagen.extraction.manifest import Manifest
from datagen.servers import capture


def config(model: Path, out: Path, **kw) -> ExtractionConfig:
    return ExtractionConfig(model_path=str(model), output_dir=str(out), dtype="float32",
                            device="cpu", max_length=16, backend="captured", **kw)


def originals(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "run" / "states").glob(f"*{capture.SUFFIX}"))


def test_each_captured_file_is_freed_only_after_its_manifest_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: three captured samples, and a manifest that notes whether each sample's captured
    # file was still there when its line was written
    model, shard = captured_shard(tmp_path, [(3, 6), (4, 9), (2, 5)])
    there_at_line: list[bool] = []
    append = Manifest.append

    def noting(self: Manifest, entry: dict) -> None:
        path = tmp_path / "run" / "states" / f"r{entry['idx']}{capture.SUFFIX}"
        there_at_line.append(path.is_file())
        append(self, entry)

    monkeypatch.setattr(Manifest, "append", noting)

    # When: the shard is built
    with Extractor(config(model, tmp_path / "hs")) as ex:
        result = ex.run_shard(shard)

    # Then: every file was there at its line and is gone after, marked with its row
    assert result.written == 3 and there_at_line == [True] * 3
    assert originals(tmp_path) == []
    for idx in range(3):
        path = tmp_path / "run" / "states" / f"r{idx}{capture.SUFFIX}"
        assert capture.built_row(path) == f"rows_0-2000/data_{idx}.ckpt"
        assert capture.built_path(path).stat().st_size < 64


def test_a_crash_before_the_manifest_line_keeps_the_file_and_resume_frees_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: a build whose manifest write fails for one sample (its row already written)
    model, shard = captured_shard(tmp_path, [(3, 6), (4, 9), (2, 5)])
    append = Manifest.append

    def failing(self: Manifest, entry: dict) -> None:
        if entry["idx"] == 1:
            raise RuntimeError("killed between the row and its manifest line")
        append(self, entry)

    monkeypatch.setattr(Manifest, "append", failing)
    with Extractor(config(model, tmp_path / "hs")) as ex:
        first = ex.run_shard(shard)

    # Then: that sample's captured file stays (the row alone is not done); the others are freed
    assert first.written == 2 and [f.idx for f in first.failures] == [1]
    assert [p.name for p in originals(tmp_path)] == [f"r1{capture.SUFFIX}"]

    # When: the shard runs again
    monkeypatch.setattr(Manifest, "append", append)
    with Extractor(config(model, tmp_path / "hs")) as ex:
        second = ex.run_shard(shard)

    # Then: it completes from the file that stayed, and frees it
    assert second.written == 1 and second.skipped_done == 2 and not second.failures
    assert originals(tmp_path) == []


def test_a_file_left_after_its_manifest_line_is_freed_by_the_next_run(tmp_path: Path) -> None:
    # Given: a shard built with the files kept (as a crash after the line leaves them)
    model, shard = captured_shard(tmp_path, [(3, 6), (4, 9)])
    with Extractor(config(model, tmp_path / "hs", keep_captured_states=True)) as ex:
        assert ex.run_shard(shard).written == 2
    assert len(originals(tmp_path)) == 2

    # When: the shard runs again with freeing on
    with Extractor(config(model, tmp_path / "hs")) as ex:
        result = ex.run_shard(shard)

    # Then: nothing is rewritten and the files are freed
    assert result.skipped_done == 2 and result.written == 0
    assert originals(tmp_path) == []


def test_a_build_that_needs_a_freed_file_fails_the_sample_saying_what_to_do(
        tmp_path: Path) -> None:
    # Given: a shard already built (its captured files freed)
    model, shard = captured_shard(tmp_path, [(3, 6), (4, 9)])
    with Extractor(config(model, tmp_path / "hs")) as ex:
        assert ex.run_shard(shard).written == 2

    # When: another extraction folder builds the same samples again
    with Extractor(config(model, tmp_path / "hs2")) as ex:
        again = ex.run_shard(shard)

    # Then: each sample fails naming its file, the row that has its states, and the setting
    assert again.written == 0 and len(again.failures) == 2
    reason = {f.idx: f.reason for f in again.failures}[0]
    assert f"r0{capture.SUFFIX} was freed after the row rows_0-2000/data_0.ckpt" in reason
    assert "keep_captured_states = true" in reason


def test_prepare_still_counts_the_records_whose_files_the_build_freed(tmp_path: Path) -> None:
    # Given: a run's records with captured states, its training set built (files freed)
    from datagen.training.training_set import prepare as prepare_set
    from datagen.training.training_set import read_manifest, training_dir

    run = tmp_path / "run"
    captured_records(run, 3)
    settings = Settings(output_dir=str(run), shard_samples=4)
    prepare_set(settings, {}, None)
    before = read_manifest(training_dir(run))
    model, _ = captured_shard(tmp_path, [])
    with Extractor(config(model, tmp_path / "hs", run_dir=str(run))) as ex:
        assert ex.run_shard(run / before["shards"][0]["path"]).written == 3
    assert not list((run / "states" / "B1").glob(f"*{capture.SUFFIX}"))

    # When: prepare runs again, and the lost-attempt prune with the records' rids kept
    prepare_set(settings, {}, None)
    pruned = capture.prune(run, "B1", lambda: {f"r{i}" for i in range(3)})

    # Then: the same training set (no record looks pruned), and the marks stay
    after = read_manifest(training_dir(run))
    assert after["fingerprint"] == before["fingerprint"] and after["samples"] == 3
    assert pruned == (0, 0)
    assert len(list((run / "states" / "B1").glob(f"*{capture.BUILT}"))) == 3
    assert json.dumps(after["shards"]) == json.dumps(before["shards"])


def test_a_changed_set_says_which_rows_hold_the_only_states_and_its_advice_loses_none(
        tmp_path: Path) -> None:
    # Given: a run's 3 captured samples built into the extraction folder with
    # keep_captured_states off (their captured files freed: the rows hold the only copy)
    import re

    import torch
    from safetensors.torch import load_file

    from datagen.training.training_set import (
        TrainingSetChanged,
        extraction_dir,
        read_manifest,
        training_dir,
    )
    from datagen.training.training_set import prepare as prepare_set

    run = tmp_path / "run"
    captured_records(run, 3)
    captured = {i: {k: v.clone() for k, v in  # copied: the build truncates the file
                    load_file(str(run / "states" / "B1" / f"r{i}{capture.SUFFIX}")).items()}
                for i in range(3)}
    settings = Settings(output_dir=str(run), shard_samples=4)
    prepare_set(settings, {}, None)
    shard = run / read_manifest(training_dir(run))["shards"][0]["path"]
    model, _ = captured_shard(tmp_path, [])
    extracted = extraction_dir(settings)
    with Extractor(config(model, extracted, run_dir=str(run))) as ex:
        assert ex.run_shard(shard).written == 3
    assert not list((run / "states" / "B1").glob(f"*{capture.SUFFIX}"))

    # When: the records change (one more sample), and prepare runs, then with --force
    captured_records(run, 4)
    with pytest.raises(TrainingSetChanged) as refused:
        prepare_set(settings, {}, None)
    with pytest.raises(TrainingSetChanged) as forced:
        prepare_set(settings, {}, None, force=True)

    # Then: both say how many rows hold the only copy and where, and --force does not go on
    # (the old advice, "remove the folder (or pass --force)", lost those states for good)
    for said in (str(refused.value), str(forced.value)):
        assert "3 of its rows hold the only copy" in said
        assert f"removing {extracted} loses them for good" in said
        assert "or remove" not in said
    assert "--force does not lead there" in str(forced.value)
    assert read_manifest(training_dir(run))["samples"] == 3  # nothing rewritten

    # When: the operator follows the advice: the folder moved aside, prepare again
    aside = Path(re.search(r"mv \S+ (\S+?);", str(refused.value)).group(1))
    extracted.rename(aside)
    tset = prepare_set(settings, {}, None)

    # Then: the new set is written, and every sample's states are there, whole, in the row
    # its mark names under the folder kept aside: nothing lost
    assert tset.samples == 4
    for i in range(3):
        row = capture.built_row(run / "states" / "B1" / f"r{i}{capture.SUFFIX}")
        states = torch.load(aside / row, weights_only=True)
        n = len(states["input_ids"])
        assert states["input_ids"].tolist() == captured[i]["input_ids"][:n].tolist()
        assert torch.equal(states["hidden_state"][0], captured[i]["hidden_state"][:n])
        assert torch.equal(states["aux_hidden_state"][0], captured[i]["aux_hidden_state"][:n])
