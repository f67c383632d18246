"""regenerate = "all": every assistant turn generated in order, through real workers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from conftest import Stack, wait_until, write_jsonl

from datagen.extraction.files import prepare as prepare_sample
from datagen.extraction.files import sample_tensors
from datagen.generation.follower import follow
from datagen.generation.records import iter_records, records_dir
from datagen.training.training_set import prepare
from producers.producer import Producer
from simulator.config import SimulatorConfig
from simulator.lengths import output_sha, plan_output

MAX_NEW = 24


def sharegpt(i: int, turns: int) -> dict[str, Any]:
    conv: list[dict[str, str]] = [{"from": "system", "value": f"Be brief, number {i}."}]
    for t in range(turns):
        conv += [{"from": "human", "value": f"Question {t + 1} of sample {i}: why?"},
                 {"from": "gpt", "value": f"the dataset's old answer {t + 1}"}]
    return {"id": f"s{i}", "conversations": conv}


def records(settings: Any, dataset: str) -> list[dict[str, Any]]:
    return [r for r in iter_records(records_dir(settings.output_dir, dataset))
            if isinstance(r, dict)]


def spans_of(rec: dict[str, Any]) -> list[list[int]]:
    """Each generated turn's [start, end) in prompt_ids + output_ids (one turn: no field)."""
    return [t["span"] for t in rec["turns"]] if "turns" in rec else \
        [[len(rec["prompt_ids"]), n_ids(rec)]]


def n_ids(rec: dict[str, Any]) -> int:
    return len(rec["prompt_ids"]) + len(rec["output_ids"])


def planned(stack: Stack, prompt_ids: list[int], max_new: int) -> list[int]:
    config = SimulatorConfig(lengths="uniform:3:12", vocab_size=stack.encoder.vocab_size,
                             eos_token_id=stack.encoder.eos_token_id)
    return plan_output(config, prompt_ids, max_new).ids


def test_every_turn_is_generated_after_the_generated_ones_and_trained_on(stack: Stack) -> None:
    # Given: multi-turn ShareGPT samples (3, 2 and 1 turns) and regenerate = "all"
    stack.start_simulator("--lengths", "uniform:3:12", "--decode-step-s", "0.001")
    rows = [sharegpt(0, 3), sharegpt(1, 2), sharegpt(2, 1), sharegpt(3, 3)]
    write_jsonl(stack.tmp / "partition" / "M1.jsonl", rows)
    settings = stack.configure(data_dir=str(stack.tmp / "partition"), regenerate="all",
                               short_concurrency=4, short_max_tokens=MAX_NEW, shard_samples=10)
    stack.worker("short")
    stack.wait_workers(1)

    # When: the run ends
    ledger = stack.ledger()
    Producer(settings, stack.app(), ledger).run()
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)

    # Then: each turn's prompt is the earlier prompt + its exact output + the template's ids
    # of the next user turn, and each turn's output is what the server generated for it
    # Every turn of a sample runs under its lease's rid, one after another, in log order.
    finished: dict[str, list[dict]] = {}
    for e in stack.sim_log():
        if e["event"] == "finish":
            finished.setdefault(e["rid"], []).append(e)
    done = {r["id"]: r for r in records(settings, "M1")}
    assert sorted(done) == ["s0", "s1", "s2", "s3"]
    eos = stack.encoder.eos_token_id
    for row in rows:
        rec = done[row["id"]]
        messages = rec["messages"]
        first, between = stack.encoder.encode_turns(messages)
        ids = rec["prompt_ids"] + rec["output_ids"]
        spans = spans_of(rec)
        assert len(spans) == len(between) + 1 == sum(m["role"] == "user" for m in messages)
        assert ids[:spans[0][0]] == first
        for n, (start, end) in enumerate(spans):
            out = ids[start:end]
            assert out == planned(stack, ids[:start], MAX_NEW)
            answer = finished[rec["rid"]][n]
            assert answer["output_sha"] == output_sha(out) and answer["prompt_tokens"] == start
            if n + 1 < len(spans):
                assert out[-1] == eos and between[n][0] == eos  # the close is written once
                assert ids[end:spans[n + 1][0]] == between[n][1:]
        assert spans[-1] == [len(rec["prompt_ids"]), len(ids)]
        assert rec["completion_tokens"] == sum(e - s for s, e in spans)
        assert rec["prompt_tokens"] == len(ids) - rec["completion_tokens"]

    # The budget counts every turn of every sample, once.
    snap = ledger.snapshot("M1")
    assert snap["tokens"] == sum(r["trainable_tokens"] for r in done.values())
    assert snap["stats"]["samples"] == 4

    # The training rows carry the spans, and the files' loss mask is 1 exactly on them.
    prepare(settings, {"M1": ledger.committed("M1")}, None)
    shard = Path(settings.output_dir) / "training" / "shards" / "shard_00000.jsonl"
    for line_no, line in enumerate(shard.read_text().splitlines(), 1):
        row = json.loads(line)
        rec = done[row["id"]]
        spans = spans_of(rec)
        assert row.get("loss_spans", [[len(rec["prompt_ids"]), n_ids(rec)]]) == spans
        sample = prepare_sample(line_no, row, 4096, "truncate", stack.encoder.vocab_size)
        n = sample.length
        tensors = sample_tensors(sample, torch.zeros(1, n, 3), torch.zeros(1, n, 1))
        expected = torch.zeros(n, dtype=torch.int64)
        for start, end in spans:
            expected[start:end] = 1
        assert torch.equal(tensors["loss_mask"], expected)
        assert tensors["input_ids"].tolist() == rec["prompt_ids"] + rec["output_ids"]


def test_regenerate_last_keeps_the_datasets_earlier_answers(stack: Stack) -> None:
    stack.start_simulator("--lengths", "uniform:3:12", "--decode-step-s", "0.001")
    write_jsonl(stack.tmp / "partition" / "M1.jsonl", [sharegpt(0, 3)])
    settings = stack.configure(data_dir=str(stack.tmp / "partition"), short_max_tokens=MAX_NEW)
    stack.worker("short")
    stack.wait_workers(1)
    ledger = stack.ledger()
    Producer(settings, stack.app(), ledger).run()
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)
    (rec,) = records(settings, "M1")
    assert "turns" not in rec
    assert rec["prompt_ids"] == stack.encoder.encode(rec["messages"])
    assert "the dataset's old answer 2" in stack.encoder.decode(rec["prompt_ids"])
    assert [e["event"] for e in stack.sim_log()].count("finish") == 1


def slow_turns(stack: Stack, dataset: str, **settings: Any) -> Any:
    """One 3-turn sample whose turns take a while each, so a test can act between them."""
    stack.start_simulator("--lengths", "fixed:20", "--decode-step-s", "0.05")
    write_jsonl(stack.tmp / "partition" / f"{dataset}.jsonl", [sharegpt(0, 3)])
    return stack.configure(data_dir=str(stack.tmp / "partition"), regenerate="all",
                           short_concurrency=2, short_max_tokens=MAX_NEW, **settings)


def started(stack: Stack) -> list[str]:
    """The rid of every request started, in order: each turn of a sample runs under its
    lease's rid, so one sample's turns are consecutive repeats of one rid."""
    return [e["rid"] for e in stack.sim_log() if e["event"] == "start"]


def test_a_worker_killed_between_turns_has_its_sample_redone_and_counted_once(
        stack: Stack) -> None:
    # Given: a worker generating a 3-turn sample
    settings = slow_turns(stack, "M2")
    victim = stack.worker("short", name="victim")
    stack.wait_workers(1)
    ledger = stack.ledger()
    Producer(settings, stack.app(), ledger).run()

    # When: it is SIGKILLed once its first turn is done and the second has started
    wait_until(lambda: len(started(stack)) >= 2, 180, what="the second turn to start")
    victim.kill()
    assert records(settings, "M2") == [] and ledger.snapshot("M2")["stats"].get("samples", 0) == 0
    stack.worker("short", name="rescuer")
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)

    # Then: the sample was redone from its first turn, stored once and counted once
    (rec,) = records(settings, "M2")
    rids = started(stack)
    victims = rids[0]
    assert rids[:2] == [victims, victims] and rids[2:] == [rec["rid"]] * 3
    snap = ledger.snapshot("M2")
    assert snap["stats"]["samples"] == 1 and snap["stats"].get("duplicates", 0) == 0
    # (60 generated; the row's last position trains nothing: SpecForge zeroes it)
    assert snap["tokens"] == rec["trainable_tokens"] == 59 and rec["completion_tokens"] == 60
    assert len(rec["turns"]) == 3


def test_a_close_between_turns_starts_no_further_turn_and_commits_nothing(
        stack: Stack) -> None:
    # Given: a 3-turn sample under way
    settings = slow_turns(stack, "M3")
    stack.worker("short")
    stack.wait_workers(1)
    ledger = stack.ledger()
    Producer(settings, stack.app(), ledger).run()
    wait_until(lambda: len(started(stack)) == 2, 180, what="the second turn to start")

    # When: the dataset closes while its second turn runs
    ledger.close("M3", "test")

    # Then: the second turn finishes, no third one starts, and nothing is stored or counted
    wait_until(lambda: ledger.snapshot("M3")["in_flight"] == 0, 180, what="the sample to end")
    assert len(started(stack)) == 2  # no third turn
    assert records(settings, "M3") == []
    stats = ledger.snapshot("M3")["stats"]
    assert stats.get("samples", 0) == 0 and stats.get("tokens", 0) == 0
    assert stats["discarded_tokens"] == 40  # the two turns generated, thrown away
