"""The generation phase end to end: real Redis, real worker processes, the simulator over HTTP."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from conftest import Stack, write_jsonl

from datagen.generation.follower import follow
from datagen.generation.merge import merge_dataset
from datagen.generation.records import iter_records, records_dir
from producers.producer import Producer
from simulator.config import SimulatorConfig
from simulator.lengths import plan_output

MEAN_OUTPUT_TOKENS = 40


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def make_partition(root: Path) -> tuple[Path, dict[str, list[list[dict[str, str]]]]]:
    """Three datasets in three record shapes; B3 has a prompt that goes to the long queue.

    Also returns each dataset's chat messages as the producer must read them (the ShareGPT
    answer dropped), to check the records against.
    """
    part = root / "partition"
    chat = [user(f"Say hello number {i}") for i in range(12)]
    write_jsonl(part / "B1_chat" / "a.jsonl",
                [{"id": f"chat-{i}", "messages": m} for i, m in enumerate(chat)])
    share = [f"What is {i} plus {i}?" for i in range(10)]
    write_jsonl(part / "B2_share.jsonl", [
        {"conversations": [{"from": "human", "value": q},
                           {"from": "gpt", "value": "old answer to regenerate"}]}
        for q in share])
    long_text = " ".join(f"word{i}" for i in range(700))
    plain = [f"Summarise item {i}" for i in range(7)] + [long_text]
    write_jsonl(part / "B3_plain" / "p.jsonl", [{"prompt": text} for text in plain])
    return part, {"B1_chat": chat, "B2_share": [user(q) for q in share],
                  "B3_plain": [user(text) for text in plain]}


def output_sha(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()


def expected_output(stack: Stack, settings: Any, rec: dict[str, Any]) -> list[int]:
    """The ids the simulator generates for this record's prompt and max_new_tokens."""
    config = SimulatorConfig(mean_output_tokens=MEAN_OUTPUT_TOKENS,
                             vocab_size=stack.encoder.vocab_size,
                             eos_token_id=stack.encoder.eos_token_id)
    return plan_output(config, rec["prompt_ids"], settings.queue_limits(rec["queue"])[1]).ids


def run_to_end(stack: Stack, settings: Any, timeout_s: float = 120) -> Any:
    ledger = stack.ledger()
    app = stack.app()
    reports = Producer(settings, app, ledger).run()
    follow(ledger, 0.3, app=app, timeout_s=timeout_s)
    return reports, ledger


def test_three_datasets_run_to_completion_and_rerun_enqueues_nothing(stack: Stack) -> None:
    # Given: a simulator, a short and a long worker, a 3-dataset partition
    stack.start_simulator("--mean-output-tokens", str(MEAN_OUTPUT_TOKENS),
                          "--decode-step-s", "0.002", "--max-running-requests", "16")
    part, prompts = make_partition(stack.tmp)
    settings = stack.configure(data_dir=str(part),
                               long_threshold_tokens=400, short_concurrency=8,
                               long_concurrency=2, short_max_tokens=128, long_max_tokens=256,
                               train_max_length=4096)  # the long prompt (~2,100 ids) fits
    stack.worker("short")
    stack.worker("long")
    stack.wait_workers(2)

    # When: the producer runs and the workers drain the queues
    reports, ledger = run_to_end(stack, settings)

    # Then: every sample is stored once with the whole chat-templated prompt, its output
    # equals what the simulator sent, and each counter equals the sum of its records' tokens
    by_name = {r.dataset: r for r in reports}
    assert {n: r.enqueued for n, r in by_name.items()} == {"B1_chat": 12, "B2_share": 10,
                                                          "B3_plain": 8}
    assert by_name["B3_plain"].long == 1 and by_name["B3_plain"].short == 7
    sent = {e["rid"]: e for e in stack.sim_log() if e["event"] == "finish"}
    for name, expected in (("B1_chat", 12), ("B2_share", 10), ("B3_plain", 8)):
        records = [r for r in iter_records(records_dir(settings.output_dir, name))]
        assert len(records) == expected
        assert len({r["id"] for r in records}) == expected
        assert sorted(map(json.dumps, (r["messages"] for r in records))) == \
            sorted(map(json.dumps, prompts[name]))
        for rec in records:
            assert rec["rid"] in sent, "a record whose request the simulator never finished"
            answer = sent[rec["rid"]]
            assert answer["dataset"] == name
            # Every prompt token, not only the first, is the tokenizer's chat template.
            assert rec["prompt_ids"] == stack.encoder.encode(rec["messages"])
            # The simulator's output is a digest of the prompt ids it received, so the same
            # output from the recorded prompt proves the server got exactly these ids.
            assert rec["output_ids"] == expected_output(stack, settings, rec)
            assert output_sha(rec["output_ids"]) == answer["output_sha"]
            assert rec["completion_tokens"] == len(rec["output_ids"]) \
                == answer["completion_tokens"]
            assert rec["prompt_tokens"] == len(rec["prompt_ids"]) == answer["prompt_tokens"]
        snap = ledger.snapshot(name)
        assert snap["tokens"] == sum(r["trainable_tokens"] for r in records)
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


def test_a_prompt_clamped_to_the_context_limit_is_accepted_by_the_server(stack: Stack) -> None:
    # Given: a server whose context (64 tokens) leaves less room than max_new_tokens, and
    # that enforces SGLang's rule (prompt + max_new_tokens >= context is refused)
    stack.start_simulator("--context-length", "64", "--lengths", "fixed:500",
                          "--decode-step-s", "0.001")
    write_jsonl(stack.tmp / "partition" / "B1.jsonl",
                [{"id": f"s{i}", "prompt": "word " * (i + 1)} for i in range(6)])
    settings = stack.configure(data_dir=str(stack.tmp / "partition"), short_concurrency=3,
                               short_max_tokens=100, keep_truncated=True)
    stack.worker("short")
    stack.wait_workers(1)
    # When: the producer clamps to the context it reads from /server_info, and the run ends
    ledger = stack.ledger()
    reports = Producer(settings, stack.app(), ledger).run()
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)
    # Then: every clamped request was accepted; asked for context - prompt - 1 tokens, each got
    # one fewer, as from SGLang 0.5.23, whose scheduler lowers a cap at the context edge to
    # context - 2 - prompt (tests/real_sglang/test_simulator_matches_sglang.py)
    assert reports[0].clamped == 6
    assert ledger.dead("B1") == {}
    done = [r for r in iter_records(records_dir(settings.output_dir, "B1"))
            if isinstance(r, dict)]
    assert len(done) == 6
    assert all(r["prompt_tokens"] + r["completion_tokens"] == 62 for r in done)
    assert not [e for e in stack.sim_log() if e["event"] == "reject"]
