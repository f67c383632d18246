"""Merging and rebuilding from the workers' record files, streamed through an index."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from config.settings import Settings
from datagen.generation.index import iter_index
from datagen.generation.ledger import Ledger, connect
from datagen.generation.merge import merge_dataset
from datagen.generation.records import Problem, canonical, iter_records, merged_path, records_dir
from datagen.generation.recovery import rebuild_dataset


def record(sid: str, rid: str, time: float, output: int = 3, **extra: Any) -> dict[str, Any]:
    return {"v": 1, "id": sid, "dataset": "B1", "rid": rid, "prompt_ids": [1, 2],
            "output_ids": [7] * output, "prompt_tokens": 2, "completion_tokens": output,
            "truncated": False, "time": time, "text": "caf\u00e9 \u2603", **extra}


def compact(rec: dict[str, Any]) -> str:
    return json.dumps(rec, separators=(",", ":"), ensure_ascii=False) + "\n"


def write_lines(path: Path, lines: list[str | bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        for line in lines:
            fh.write(line if isinstance(line, bytes) else line.encode("utf-8"))
    return path


# Two workers' files: s1 and s2 written twice, s3 never committed, an old-format line in
# json.dumps' default spacing, and one line of each kind the merge reports.
S1_LATE = record("s1", "r1", 10.0, output=5)
S1_EARLY = record("s1", "r2", 5.0, output=6)
S2_A = record("s2", "r3", 3.0)
S2_B = record("s2", "r4", 2.0, output=4)
S3 = record("s3", "r5", 1.0)
S4_OLD = {"id": "s4", "dataset": "B1", "response": "text only", "completion_tokens": 9,
          "time": 4.0}
S5 = record("s5", "r6", 4.0, truncated=True)
COMMITTED = {"s1": "r1 5", "s2": "r3 3", "s4": "adopted 9", "s5": "r6 3"}


@pytest.fixture
def out(tmp_path: Path) -> Path:
    folder = records_dir(tmp_path, "B1")
    write_lines(folder / "hostA-1.jsonl", [
        compact(S1_LATE), compact(S2_A), "{not json\n", compact(S3), json.dumps(S4_OLD) + "\n",
        '["no", "id"]\n', compact(S5)])
    write_lines(folder / "hostB-2.jsonl", [
        compact(S1_EARLY), "\n", compact(S2_B), compact(record("s6", "r7", 6.0))[:40]])
    return tmp_path


def merged(out: Path) -> bytes:
    return merged_path(out, "B1").read_bytes()


def test_merge_keeps_the_committed_copies_and_reports_unreadable_lines(out: Path) -> None:
    report = merge_dataset(out, "B1", COMMITTED)

    # The committed rid wins over an earlier copy; s3 and the torn s6 are left out; the
    # old line comes out in the compact form; the order is (time, id).
    assert merged(out) == "".join(compact(r) for r in (S2_A, S4_OLD, S5, S1_LATE)).encode()
    assert (report.records, report.duplicates, report.uncommitted) == (4, 2, 1)
    assert (report.prompt_tokens, report.completion_tokens) == (6, 3 + 9 + 3 + 5)
    folder = records_dir(out, "B1")
    assert report.problems == [f"{folder / 'hostA-1.jsonl'}:3: invalid JSON",
                               f"{folder / 'hostA-1.jsonl'}:6: not a record (no id)",
                               f"{folder / 'hostB-2.jsonl'}:4: torn last line "
                               "(writer killed mid-write)"]


def test_without_the_ledger_the_earliest_copy_wins_and_nothing_is_uncommitted(
        out: Path) -> None:
    report = merge_dataset(out, "B1")
    assert merged(out) == "".join(
        compact(r) for r in (S3, S2_B, S4_OLD, S5, S1_EARLY)).encode()
    assert (report.records, report.duplicates, report.uncommitted) == (5, 2, 0)


def test_uncommitted_records_can_be_kept(out: Path) -> None:
    report = merge_dataset(out, "B1", COMMITTED, include_uncommitted=True)
    assert merged(out) == "".join(
        compact(r) for r in (S3, S2_A, S4_OLD, S5, S1_LATE)).encode()
    assert report.uncommitted == 0


def test_equal_times_fall_back_to_the_smaller_rid(tmp_path: Path) -> None:
    folder = records_dir(tmp_path, "B1")
    write_lines(folder / "a.jsonl", [compact(record("s1", "rb", 1.0))])
    write_lines(folder / "b.jsonl", [compact(record("s1", "ra", 1.0, output=9))])
    merge_dataset(tmp_path, "B1")
    assert merged(tmp_path) == compact(record("s1", "ra", 1.0, output=9)).encode()


def test_rebuild_counts_the_chosen_records_old_formats_included(out: Path,
                                                                redis_url: str) -> None:
    # Given: besides the records above, one old record without any token count and one
    # with output ids but no completion_tokens
    write_lines(records_dir(out, "B1") / "old-3.jsonl", [
        json.dumps({"id": "s7", "dataset": "B1", "response": "?"}) + "\n",
        json.dumps({"id": "s8", "dataset": "B1", "output_ids": [1] * 11}) + "\n"])
    ledger = Ledger(connect(redis_url), Settings(redis_url=redis_url, output_dir=str(out),
                                                 token_budget=10**6))

    rebuilt = rebuild_dataset(ledger, "B1")

    # Then: one sample per id, the earliest copy (Redis knew nothing), s7 not counted
    chosen = {"s1": S1_EARLY, "s2": S2_B, "s3": S3, "s5": S5}
    completions = [6, 4, 3, 3, 9, 11]  # s1 s2 s3 s5 s4 s8
    assert (rebuilt.samples, rebuilt.tokens) == (6, sum(completions))
    assert (rebuilt.duplicates, rebuilt.old_format, rebuilt.unknown_tokens) == (2, 3, 1)
    assert len(rebuilt.problems) == 3 and not rebuilt.closed
    done = ledger.committed("B1")
    assert done == {**{s: f"{r['rid']} {r['completion_tokens']}" for s, r in chosen.items()},
                    "s4": "adopted 9", "s8": "adopted 11"}
    stats = ledger.snapshot("B1")["stats"]
    assert stats["completion_tokens"] == sum(completions)
    assert stats["prompt_tokens"] == 2 * 4 and stats["truncated"] == 1
    lengths = ledger.r.lrange(ledger.k("B1", "lengths"), 0, -1)
    assert sorted(int(x) for x in lengths) == sorted(completions)


def test_rebuild_over_the_budget_closes_and_drops_pending(out: Path, redis_url: str) -> None:
    ledger = Ledger(connect(redis_url), Settings(redis_url=redis_url, output_dir=str(out),
                                                 token_budget=10))
    ledger.add_pending("B1", {"s9": "{}"})
    rebuilt = rebuild_dataset(ledger, "B1")
    assert rebuilt.closed and ledger.closed("B1") == "budget"
    assert ledger.pending_ids("B1") == set()


@pytest.mark.parametrize("committed", [None, COMMITTED], ids=["no-ledger", "ledger"])
def test_the_streamed_merge_writes_what_merging_whole_records_wrote(
        out: Path, committed: dict[str, str] | None) -> None:
    # The merge as it was before the index: whole records chosen by canonical, re-encoded.
    chosen, _, _ = canonical(iter_records(records_dir(out, "B1")), committed)
    kept = [r for sid, r in chosen.items() if committed is None or sid in committed]
    kept.sort(key=lambda r: (r.get("time", 0), str(r["id"])))
    merge_dataset(out, "B1", committed)
    assert merged(out) == "".join(compact(r) for r in kept).encode()


def test_compact_lines_are_copied_and_other_lines_re_encoded(out: Path) -> None:
    entries = [e for e in iter_index(records_dir(out, "B1"), check_verbatim=True)
               if not isinstance(e, Problem)]
    assert {e.id for e in entries if not e.verbatim} == {"s4"}  # the spaced old line
    # An index for counting only does not pay for the check: nothing is copied from it.
    assert not any(e.verbatim for e in iter_index(records_dir(out, "B1"))
                   if not isinstance(e, Problem))


def test_a_record_whose_captured_states_were_pruned_is_never_chosen_again(
        tmp_path: Path, redis_url: str) -> None:
    # Given: s1 stored twice with capture on: the earliest copy's attempt was never counted
    # and prepare pruned its file; the later copy's file is there
    folder = records_dir(tmp_path, "B1")
    states = tmp_path / "states" / "B1"
    states.mkdir(parents=True)
    (states / "r2.safetensors").write_bytes(b"x")
    write_lines(folder / "hostA-1.jsonl", [
        compact(record("s1", "r1", 1.0, states="states/B1/r1.safetensors")),
        compact(record("s1", "r2", 2.0, states="states/B1/r2.safetensors"))])

    # When: merged without the ledger, and the ledger rebuilt from the records
    report = merge_dataset(tmp_path, "B1", None)
    ledger = Ledger(connect(redis_url), Settings(redis_url=redis_url, output_dir=str(tmp_path)))
    ledger.register(["B1"])
    rebuild_dataset(ledger, "B1")

    # Then: both take the copy whose states exist
    merged = merged_path(tmp_path, "B1").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["rid"] for line in merged] == ["r2"]
    assert report.states_gone == 1 and report.duplicates == 0
    assert ledger.committed("B1") == {"s1": "r2 3"}
