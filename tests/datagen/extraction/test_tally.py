"""The run's state-check total (datagen/extraction/tally.py) read from the durable lines: a
shard run twice (a resume, a duplicate delivery) and a sample that failed and then passed on a
rerun count once, as what their last outcome says."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import write_jsonl

from datagen.extraction import tally


def test_the_total_counts_each_sample_once_by_its_last_outcome(tmp_path: Path) -> None:
    # Given: shard a written twice (a resume rewrote idx 1), idx 2 failed then passed on a
    # rerun, idx 3 failed, idx 4 written without log-probabilities, idx 5 dead for another reason
    line = {"dataset": "B1", "path": "x", "tokens": 9}
    write_jsonl(tmp_path / "manifest" / "a.jsonl", [
        {**line, "idx": 0, "id": "s0", "checked": 5, "gap": 0.001},
        {**line, "idx": 1, "id": "s1", "checked": 5, "gap": 0.002},
        {**line, "idx": 1, "id": "s1", "checked": 5, "gap": 0.002}])
    write_jsonl(tmp_path / "manifest" / "b.jsonl", [
        {**line, "idx": 2, "id": "s2", "checked": 5, "gap": 0.003},
        {**line, "idx": 4, "id": "s4", "checked": 0, "gap": 0.0}])
    (tmp_path / "manifest" / "b.jsonl").open("a").write('{"idx": 9, "id"')  # torn by a kill
    letter = {"kind": "sample", "shard": "b", "reason": "state check: ...", "time": 0}
    write_jsonl(tmp_path / tally.DEAD_LETTERS, [
        {**letter, "idx": 2, "id": "s2", "checked": 5, "gap": 0.9},
        {**letter, "idx": 3, "id": "s3", "checked": 4, "gap": 1.7},
        {"kind": "sample", "shard": "b", "idx": 5, "id": "s5", "reason": "write failed"},
        {"kind": "shard", "shard": "c", "idx": None, "id": None, "reason": "BadInput"}])
    (tmp_path / "extraction.json").write_text(json.dumps({"dtype": "float32"}))

    # When: the total is taken and saved
    total = tally.run_total(tmp_path)
    assert tally.save(tmp_path, total)

    # Then: 4 checked (0, 1, 2 passed; 3 failed), 1 failed, the worst gap is the failure's
    assert total == {"checked": 4, "failed": 1, "nonfinite": 0, "recaptured": 0,
                     "recapture_failed": 0, "unchecked": 1, "positions": 19,
                     "worst_gap": 1.7, "worst_idx": 3, "worst_id": "s3"}
    saved = json.loads((tmp_path / "extraction.json").read_text())
    assert saved["dtype"] == "float32" and tally.saved(tmp_path) == total
    assert tally.describe(total) == (
        "state check: 4 samples checked (19 positions), 1 failed, worst gap 1.7 nats (sample "
        "idx 3, id 's3'); 1 samples not checked (check_states off, or records without "
        "log-probabilities)")


def test_a_folder_without_extraction_json_gets_no_total_written(tmp_path: Path) -> None:
    assert tally.run_total(tmp_path)["checked"] == 0
    assert not tally.save(tmp_path, tally.run_total(tmp_path))
    assert tally.saved(tmp_path) is None


def test_a_sample_failed_for_nan_states_counts_failed_and_a_nan_gap_is_no_worst(
        tmp_path: Path) -> None:
    # Given: one sample passed, one dead-lettered for a NaN in its states (no positions
    # measured), one whose letter carries a NaN gap (an older writer's)
    write_jsonl(tmp_path / "manifest" / "a.jsonl", [
        {"idx": 0, "id": "s0", "dataset": "B1", "path": "x", "tokens": 9, "checked": 5,
         "gap": 0.001}])
    letter = {"kind": "sample", "shard": "a", "reason": "state check: ...", "time": 0}
    write_jsonl(tmp_path / tally.DEAD_LETTERS, [
        {**letter, "idx": 1, "id": "s1", "checked": 0, "gap": 0.0, "nonfinite": 3},
        {**letter, "idx": 2, "id": "s2", "checked": 5, "gap": float("nan")}])

    total = tally.run_total(tmp_path)

    # Then: both failures count as checked and failed, one of them for non-finite states,
    # and the worst gap stays a number
    assert (total["checked"], total["failed"], total["nonfinite"]) == (3, 2, 1)
    assert total["worst_gap"] == 0.001 and total["unchecked"] == 0
    assert "2 failed (1 with NaN or inf states)" in tally.describe(total)


def test_samples_that_differ_from_the_servers_prefill_raise_an_alert(tmp_path: Path) -> None:
    # Given: two samples re-captured on the server: one alike (written), one not (its letter)
    write_jsonl(tmp_path / "manifest" / "a.jsonl", [
        {"idx": 0, "id": "s0", "dataset": "B1", "path": "x", "tokens": 9, "checked": 5,
         "gap": 0.001, "recaptured": True}])
    write_jsonl(tmp_path / tally.DEAD_LETTERS, [
        {"kind": "sample", "shard": "a", "idx": 1, "id": "s1", "reason": "state check: "
         "re-capture: ...", "time": 0, "checked": 0, "gap": 0.0, "recapture": True}])

    total = tally.run_total(tmp_path)

    assert (total["recaptured"], total["recapture_failed"], total["failed"]) == (2, 1, 1)
    assert "ALERT: 1 of 2 samples re-captured by a prefill on the server differ" in \
        tally.describe(total)
    (tmp_path / tally.DEAD_LETTERS).unlink()
    assert "; 1 re-captured on the server, all alike" in tally.describe(
        tally.run_total(tmp_path))
