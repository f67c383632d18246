"""`datagen prepare`: merge, truncation policy, dedup, deterministic shuffle and shards,
conversations decoded from the output ids. Records are written as workers write them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import write_jsonl

from config.settings import Settings
from datagen.generation.records import merged_path
from datagen.training.text_rows import TextRows
from datagen.training.training_set import (
    TrainingSetChanged,
    extraction_dir,
    prepare,
    read_manifest,
    render,
    training_dir,
)


def record(dataset: str, sid: str, prompt: list[int], output: list[int], **extra: Any) -> dict:
    return {"v": 1, "id": sid, "dataset": dataset, "rid": f"rid-{dataset}-{sid}",
            "messages": [{"role": "user", "content": f"question {sid}"}],
            "prompt_ids": prompt, "output_ids": output, "finish_reason": "stop",
            "prompt_tokens": len(prompt), "completion_tokens": len(output), "truncated": False,
            "time": 1000.0 + len(sid), **extra}


def write_records(out: Path, dataset: str, records: list[dict], worker: str = "h-1") -> None:
    write_jsonl(out / "records" / dataset / f"{worker}.jsonl", records)


def settings_for(out: Path, **changes: Any) -> Settings:
    return Settings(**{"output_dir": str(out), "shard_samples": 4, **changes})


def shard_lines(out: Path) -> list[dict]:
    lines = []
    for path in sorted((training_dir(out) / "shards").glob("shard_*.jsonl")):
        lines += [json.loads(x) for x in path.read_text().splitlines()]
    return lines


def some_records(n: int, dataset: str = "B1") -> list[dict]:
    return [record(dataset, f"{dataset}-{i}", [1, 3, 10 + i], [20 + i, 30 + i, 2])
            for i in range(n)]


def test_same_records_give_identical_shards_and_another_seed_another_order(tmp_path):
    out = tmp_path / "out"
    write_records(out, "B1", some_records(7, "B1"))
    write_records(out, "A1", some_records(4, "A1"))
    settings = settings_for(out)

    first = prepare(settings, {}, None)
    files = {p.name: p.read_bytes() for p in (training_dir(out) / "shards").iterdir()}
    again = prepare(settings, {}, None)

    assert sorted(files) == ["shard_00000.jsonl", "shard_00001.jsonl", "shard_00002.jsonl"]
    assert {p.name: p.read_bytes() for p in (training_dir(out) / "shards").iterdir()} == files
    assert again.fingerprint == first.fingerprint
    lines = shard_lines(out)
    assert [x["idx"] for x in lines] == list(range(11))
    assert set(lines[0]) == {"idx", "id", "dataset", "prompt_ids", "output_ids"}
    assert sorted(x["id"] for x in lines) == sorted(f"A1-{i}" for i in range(4)) + sorted(
        f"B1-{i}" for i in range(7))
    manifest = read_manifest(training_dir(out))
    assert [s["samples"] for s in manifest["shards"]] == [4, 4, 3]
    assert manifest["samples"] == 11 and manifest["tokens"] == 11 * 6
    assert manifest["datasets"]["B1"]["output_tokens"] == 21
    assert manifest["shards"][1] == {**manifest["shards"][1], "first_idx": 4,
                                     "path": "training/shards/shard_00001.jsonl"}
    order = [x["id"] for x in lines]
    prepare(settings_for(out, shuffle_seed=1), {}, None)
    assert [x["id"] for x in shard_lines(out)] != order


def test_ids_are_unique_across_datasets_and_collisions_are_reported(tmp_path):
    out = tmp_path / "out"
    write_records(out, "A1", [record("A1", "same", [1], [5, 6])])
    write_records(out, "B1", [record("B1", "same", [1], [7, 8, 9]), record("B1", "b", [1], [4])])
    # the same sample stored twice by a redelivery: merge keeps one
    write_records(out, "B1", [record("B1", "b", [1], [4], rid="later", time=5000.0)], "h-2")

    tset = prepare(settings_for(out), {}, None)

    lines = shard_lines(out)
    assert sorted((x["dataset"], x["id"]) for x in lines) == [("A1", "same"), ("B1", "b")]
    assert tset.collisions == [("same", "A1", "B1")]
    counts = {d.dataset: d for d in tset.datasets}
    assert counts["B1"].collisions == 1 and counts["B1"].copies == 1
    assert counts["B1"].samples == 1 and counts["B1"].output_tokens == 1
    table = render(tset)
    assert "id 'same' in B1 already taken by A1" in table
    assert read_manifest(training_dir(out))["collisions"] == [
        {"id": "same", "kept": "A1", "dropped": "B1"}]


@pytest.mark.parametrize("keep", [True, False])
def test_truncation_policy(tmp_path, keep):
    out = tmp_path / "out"
    write_records(out, "B1", [record("B1", "ok", [1], [5, 2]),
                              record("B1", "cut", [1], [5, 6, 7], truncated=True,
                                     finish_reason="length"),
                              {"id": "old", "dataset": "B1", "text": "no ids"}])

    tset = prepare(settings_for(out, keep_truncated=keep), {}, None)

    assert sorted(x["id"] for x in shard_lines(out)) == (["cut", "ok"] if keep else ["ok"])
    b1 = tset.datasets[0]
    assert (b1.records, b1.truncated_dropped, b1.no_ids) == (3, 0 if keep else 1, 1)


def test_a_truncated_row_that_reaches_the_window_is_kept_with_keep_truncated_off(tmp_path):
    # Given: two answers cut at max_new_tokens, one short of train_max_length (8), one whose
    # row reaches it (cap_to_window capped it there: the trainer would cut it there anyway)
    out = tmp_path / "out"
    write_records(out, "B1", [record("B1", "short", [1, 2], [5, 6, 7], truncated=True,
                                     finish_reason="length"),
                              record("B1", "window", [1, 2], [5, 6, 7, 8, 9, 10],
                                     truncated=True, finish_reason="length")])
    # When: prepared with keep_truncated off
    tset = prepare(settings_for(out, keep_truncated=False, train_max_length=8), {}, None)
    # Then: only the one cut inside the window is dropped
    assert [x["id"] for x in shard_lines(out)] == ["window"]
    assert tset.datasets[0].truncated_dropped == 1


def test_only_committed_records_when_the_ledger_answers(tmp_path):
    out = tmp_path / "out"
    write_records(out, "B1", some_records(3))

    tset = prepare(settings_for(out), {"B1": {"B1-0": "rid-B1-B1-0 3"}}, None)

    assert [x["id"] for x in shard_lines(out)] == ["B1-0"]
    assert tset.datasets[0].uncommitted == 2
    assert merged_path(out, "B1").is_file()


def test_conversations_are_the_history_plus_the_decoded_response(tmp_path, encoder):
    out = tmp_path / "out"
    text = "The answer is four <think>because</think>"
    ids = encoder._tokenizer.encode(text, add_special_tokens=False) + [encoder.eos_token_id]
    rec = record("B1", "c1", encoder.encode([{"role": "user", "content": "2+2?"}]), ids,
                 messages=[{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "2+2?"}])
    write_records(out, "B1", [rec])

    tset = prepare(settings_for(out), {},
                   lambda: TextRows(encoder))

    lines = Path(tset.conversations).read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"id": "c1", "conversations": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": text}]}]


def test_the_fingerprint_is_the_shuffled_rows_with_the_sha256_of_their_lines(tmp_path):
    # The line digests wait on disk during prepare, not in memory: the fingerprint must
    # still be the documented one, so a set prepared before is recognised as the same.
    out = tmp_path / "out"
    write_records(out, "B1", some_records(5, "B1"))
    write_records(out, "A1", some_records(3, "A1"))

    tset = prepare(settings_for(out), {}, None)

    digest = {}
    for ds in ("A1", "B1"):
        for raw in merged_path(out, ds).read_bytes().splitlines(keepends=True):
            digest[(ds, json.loads(raw)["id"])] = hashlib.sha256(raw).hexdigest()
    want = hashlib.sha256(b"v1 shard_samples=4\n")
    for row in shard_lines(out):
        want.update(f"{row['dataset']}\t{row['id']}\t{digest[row['dataset'], row['id']]}\n"
                    .encode())
    assert tset.fingerprint == want.hexdigest()
    assert read_manifest(training_dir(out))["fingerprint"] == want.hexdigest()
    # the temporary files (digests, places) are gone
    assert sorted(p.name for p in training_dir(out).iterdir() if p.name.startswith(".")) == []


def test_the_tokenizer_is_loaded_after_the_shards_are_written(tmp_path, encoder):
    # The index is freed before the decoder loads (transformers and torch: ~250 MB), so the
    # two never add up; the conversations come out in shard order all the same.
    out = tmp_path / "out"
    write_records(out, "B1", some_records(6, "B1"))
    write_records(out, "A1", some_records(5, "A1"))
    seen: list[int] = []

    def load():
        seen.append(len(list((training_dir(out) / "shards").glob("shard_*.jsonl"))))
        return TextRows(encoder)

    tset = prepare(settings_for(out), {}, load)

    assert seen == [3]  # once, with the 11 samples' 3 shards of 4 already on disk
    conversations = [json.loads(x) for x in Path(tset.conversations).read_text().splitlines()]
    shards = shard_lines(out)
    assert [c["id"] for c in conversations] == [row["id"] for row in shards]
    assert [c["conversations"][-1]["content"] for c in conversations] == [
        encoder.decode(row["output_ids"], skip_special_tokens=True) for row in shards]


def test_a_changed_set_is_refused_once_extraction_started(tmp_path):
    out = tmp_path / "out"
    write_records(out, "B1", some_records(9))
    settings = settings_for(out)
    prepare(settings, {}, None)
    manifest = extraction_dir(settings) / "manifest" / "shards__shard_00000.jsonl"
    manifest.parent.mkdir(parents=True)
    manifest.write_text('{"idx": 0, "id": "B1-3", "dataset": "B1", "path": "x", "tokens": 6}\n')
    prepare(settings, {}, None)  # the same set again is fine

    write_records(out, "B1", [record("B1", "new", [1], [2])], "h-3")
    with pytest.raises(TrainingSetChanged, match="changed since extraction started"):
        prepare(settings, {}, None)
    assert len(shard_lines(out)) == 9

    tset = prepare(settings, {}, None, force=True)
    assert tset.samples == 10 and len(shard_lines(out)) == 10


def test_shards_of_a_larger_previous_set_are_removed(tmp_path):
    out = tmp_path / "out"
    write_records(out, "B1", some_records(9))
    prepare(settings_for(out), {}, None)
    prepare(settings_for(out, shard_samples=100), {}, None)
    assert [p.name for p in (training_dir(out) / "shards").iterdir()] == ["shard_00000.jsonl"]


def test_the_length_report_agrees_with_the_online_rows_for_several_turns(tmp_path):
    # Given: two generated turns; the last turn's prompt (which holds the first turn) is
    # longer than train_max_length, but the first turn's output lies inside it
    prompt = [1, 3, 4, 20, 21, 22, 23, 2, 5, 6]  # user, turn 1 output at 3..7, user
    output = [30, 31, 32, 2]
    multi = record("B1", "B1-multi", prompt, output,
                   turns=[{"span": [3, 8]}, {"span": [10, 14]}])
    write_records(tmp_path, "B1", [multi, *some_records(3)])
    tset = prepare(settings_for(tmp_path, train_max_length=9), {"B1": None}, None)
    # Then: the report keeps it (cut), as the online rows do: nothing is counted as dropped
    # that the files and rows keep
    rows = [json.loads(x) for x in (training_dir(tmp_path) / "specforge_prompts.jsonl")
            .read_text().splitlines()]
    kept = next(r for r in rows if r["id"] == "B1-multi")
    assert len(kept["input_ids"]) == 9 and sum(kept["loss_mask"]) == 5
    assert tset.lengths["B1"].dropped == 0 and tset.lengths["B1"].cut == 1


def test_the_ledger_s_done_maps_are_read_one_dataset_at_a_time(tmp_path, redis_url):
    # `datagen prepare` reads each dataset's done map when that dataset is merged, so one map
    # is held at a time (24 bytes a sample of one dataset), not every dataset's at once.
    from cli.extraction import CommittedMaps, committed_maps
    from datagen import keys
    from datagen.generation.ledger import Ledger

    out = tmp_path / "out"
    for ds in ("A1", "B1"):
        write_records(out, ds, some_records(3, ds))
    settings = settings_for(out, redis_url=redis_url)
    ledger = Ledger.from_settings(settings)
    for ds in ("A1", "B1"):
        ledger.r.hset(keys.dataset_key(ds, keys.DONE), f"{ds}-1", f"rid-{ds}-{ds}-1 3")
    maps = committed_maps(settings)
    assert isinstance(maps, CommittedMaps) and sorted(maps) == ["A1", "B1"]
    read: list[tuple[str, list[str]]] = []
    real = ledger.committed_index

    def index(dataset: str) -> Any:
        read.append((dataset, sorted(p.parent.name for p in out.glob("*/raw_responses.jsonl"))))
        return real(dataset)

    maps.ledger.committed_index = index  # type: ignore[method-assign]

    prepare(settings, maps, None)

    assert read == [("A1", []), ("B1", ["A1"])]  # each when its merge starts
    assert sorted(x["id"] for x in shard_lines(out)) == ["A1-1", "B1-1"]


@pytest.mark.parametrize(("server_kind", "rendered_as"),
                         [("vllm", "vllm"), ("sglang", "sglang"), ("auto", "sglang")])
def test_text_rows_render_as_the_server_the_prompts_were_rendered_for(tmp_path, tokenizer_dir,
                                                                       server_kind, rendered_as):
    # The text rows are checked by rendering them back to the record's ids: with the rules of
    # the server whose rendering made the prompts (server_kind), else every row whose request
    # the two servers render differently would be written as text.
    from cli.extraction import decoder

    load = decoder(settings_for(tmp_path, tokenizer_path=str(tokenizer_dir),
                                server_kind=server_kind))
    assert load is not None
    assert load().encoder.server_kind == rendered_as


def test_a_records_logprobs_pass_into_its_shard_row_and_read_back_for_the_check() -> None:
    # Given: a record with the server's log-probabilities of its outputs and its prompt
    from datagen.extraction.files import prepare
    from datagen.generation.records import pack_logprobs
    from datagen.training.training_set import _shard_line

    record = {"id": "s", "dataset": "B1", "prompt_ids": [1, 2, 3], "output_ids": [4, 5],
              "output_logprobs": pack_logprobs([-0.5, -0.25]),
              "prompt_logprobs": pack_logprobs([-1.0, -2.0])}

    # When: its shard line is written and read back as extraction reads it
    row = json.loads(_shard_line(0, record, hashlib.sha256(), Path("unused")))
    sample = prepare(1, row, 64, "truncate", 16)

    # Then: both reach the sample the state check measures
    assert sample.logprobs == (-0.5, -0.25) and sample.prompt_logprobs == (-1.0, -2.0)
