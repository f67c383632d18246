"""The generation phase end to end: real Redis, real worker processes, the simulator over HTTP."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from conftest import Stack, write_jsonl

from cli.commands import follow
from datagen.generation.merge import merge_dataset
from datagen.generation.records import iter_records, records_dir
from producers.producer import Producer


def make_partition(root: Path) -> Path:
    """Three datasets in three record shapes; B3 has a prompt that goes to the long queue."""
    part = root / "partition"
    write_jsonl(part / "B1_chat" / "a.jsonl", [
        {"id": f"chat-{i}", "messages": [{"role": "user", "content": f"Say hello number {i}"}]}
        for i in range(12)])
    write_jsonl(part / "B2_share.jsonl", [
        {"conversations": [{"from": "human", "value": f"What is {i} plus {i}?"},
                           {"from": "gpt", "value": "old answer to regenerate"}]}
        for i in range(10)])
    long_text = " ".join(f"word{i}" for i in range(700))
    write_jsonl(part / "B3_plain" / "p.jsonl",
                [{"prompt": f"Summarise item {i}"} for i in range(7)]
                + [{"prompt": long_text}])
    return part


def output_sha(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()


def run_to_end(stack: Stack, settings: Any, timeout_s: float = 120) -> Any:
    ledger = stack.ledger()
    app = stack.app()
    reports = Producer(settings, app, ledger).run()
    follow(ledger, 0.3, app=app, timeout_s=timeout_s)
    return reports, ledger


def test_three_datasets_run_to_completion_and_rerun_enqueues_nothing(stack: Stack) -> None:
    # Given: a simulator, a short and a long worker, a 3-dataset partition
    stack.start_simulator("--mean-output-tokens", "40", "--decode-step-s", "0.002",
                          "--max-running-requests", "16")
    settings = stack.configure(data_dir=str(make_partition(stack.tmp)),
                               long_threshold_tokens=400, short_concurrency=8,
                               long_concurrency=2, short_max_tokens=128, long_max_tokens=256)
    stack.worker("short")
    stack.worker("long")
    stack.wait_workers(2)

    # When: the producer runs and the workers drain the queues
    reports, ledger = run_to_end(stack, settings)

    # Then: every sample is stored once, its output equals what the simulator sent,
    # and each counter equals the sum of its records' tokens
    by_name = {r.dataset: r for r in reports}
    assert {n: r.enqueued for n, r in by_name.items()} == {"B1_chat": 12, "B2_share": 10,
                                                          "B3_plain": 8}
    assert by_name["B3_plain"].long == 1 and by_name["B3_plain"].short == 7
    sent = {e["rid"]: e for e in stack.sim_log() if e["event"] == "finish"}
    for name, expected in (("B1_chat", 12), ("B2_share", 10), ("B3_plain", 8)):
        records = [r for r in iter_records(records_dir(settings.output_dir, name))]
        assert len(records) == expected
        assert len({r["id"] for r in records}) == expected
        for rec in records:
            assert rec["rid"] in sent, "a record whose request the simulator never finished"
            assert output_sha(rec["output_ids"]) == sent[rec["rid"]]["output_sha"]
            assert sent[rec["rid"]]["dataset"] == name
            assert rec["prompt_ids"][:1] == stack.encoder.encode(rec["messages"])[:1]
        snap = ledger.snapshot(name)
        assert snap["tokens"] == sum(r["completion_tokens"] for r in records)
        assert snap["stats"]["samples"] == expected
        merged = merge_dataset(settings.output_dir, name,
                               ledger.committed(name))
        assert merged.records == expected and merged.duplicates == 0
        lines = Path(merged.path).read_text().splitlines()
        assert len(lines) == expected

    # The long prompt went to the long queue with the long max_new_tokens.
    long_records = [r for r in iter_records(records_dir(settings.output_dir, "B3_plain"))
                    if r["queue"] == "long"]
    assert len(long_records) == 1 and len(long_records[0]["prompt_ids"]) > 400

    # A second producer run finds everything done and enqueues nothing.
    again = Producer(settings, stack.app(), ledger).run()
    assert sum(r.enqueued for r in again) == 0
    assert sum(r.already_done for r in again) == 30
