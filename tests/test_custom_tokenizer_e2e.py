"""A run with a tokenizer that is the checkpoint's own code (Kimi-style tiktoken class)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import Stack, write_jsonl

from datagen.builders.tiktoken_fixture import build_tiktoken_tokenizer
from datagen.generation.follower import follow
from datagen.generation.records import iter_records, records_dir
from datagen.tokenization.chat import ChatEncoder
from producers.producer import Producer


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiktoken_tokenizer(tmp_path_factory.mktemp("kimi") / "tok")


@pytest.fixture
def kimi_stack(tmp_path: Path, redis_url: str, kimi_dir: Path) -> Any:
    encoder = ChatEncoder(kimi_dir, {"thinking": False}, trust_remote_code=True)
    s = Stack(tmp_path, redis_url, kimi_dir, encoder)
    try:
        yield s
    finally:
        s.stop()


def test_a_run_generates_with_a_custom_code_tokenizer_end_to_end(kimi_stack: Stack) -> None:
    # Given: the simulator stopping on the tokenizer's <|im_end|>, a worker, and settings
    # that trust the tokenizer's code and turn Kimi's thinking off
    stack = kimi_stack
    stack.start_simulator("--lengths", "uniform:3:20", "--decode-step-s", "0.001")
    questions = [f"Question number {i}: what is {i} times {i}?" for i in range(6)]
    write_jsonl(stack.tmp / "partition" / "K1.jsonl",
                [{"id": f"k{i}", "prompt": q} for i, q in enumerate(questions)])
    write_jsonl(stack.tmp / "partition" / "K2.jsonl", [{"id": "chat", "messages": [
        {"role": "user", "content": "First question?"},
        {"role": "assistant", "content": "an old answer"},
        {"role": "user", "content": "Second question?"}]}])
    settings = stack.configure(data_dir=str(stack.tmp / "partition"), short_concurrency=4,
                               short_max_tokens=64, trust_remote_code=True,
                               chat_template_kwargs={"thinking": False}, regenerate="all")
    stack.worker("short")
    stack.wait_workers(1)

    # When: the producer tokenizes through the custom class and the run ends
    ledger = stack.ledger()
    reports = Producer(settings, stack.app(), ledger).run()
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)

    # Then: every prompt is the Kimi template's ids with thinking off, and every response
    # was generated and counted
    assert reports[0].enqueued == 6 and not reports[0].bad
    records = [r for r in iter_records(records_dir(settings.output_dir, "K1"))]
    assert sorted(r["id"] for r in records) == [f"k{i}" for i in range(6)]
    special = stack.encoder._tokenizer.special_tokens
    for rec in records:
        assert rec["prompt_ids"] == stack.encoder.encode(rec["messages"])
        assert rec["prompt_ids"][-2:] == [special["<think>"], special["</think>"]]
        assert stack.encoder.decode(rec["prompt_ids"]).startswith("<|im_user|>user<|im_middle|>")
        assert rec["output_ids"][-1] == special["<|im_end|>"]
    # what trains: the output ids but each row's last (SpecForge zeroes its loss)
    assert ledger.snapshot("K1")["tokens"] == sum(len(r["output_ids"]) - 1 for r in records)

    # The two-turn chat: its second prompt holds the first turn's output, then Kimi's
    # markers for the next user turn and the thinking-off generation prompt again
    (chat,) = iter_records(records_dir(settings.output_dir, "K2"))
    (a, b), (c, d) = (t["span"] for t in chat["turns"])
    ids = chat["prompt_ids"] + chat["output_ids"]
    assert ids[b - 1] == special["<|im_end|>"]
    assert stack.encoder.decode(ids[b:c]) == (
        "<|im_user|>user<|im_middle|>Second question?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>")
    assert ids[a - 2:a] == [special["<think>"], special["</think>"]]
    assert ledger.snapshot("K2")["tokens"] == (b - a) + (d - c) - 1  # the row's last: no loss


def test_the_producer_refuses_a_custom_code_tokenizer_without_trust(kimi_stack: Stack) -> None:
    stack = kimi_stack
    stack.start_simulator()
    write_jsonl(stack.tmp / "partition" / "K1.jsonl", [{"prompt": "hello"}])
    settings = stack.configure(data_dir=str(stack.tmp / "partition"))
    with pytest.raises(ValueError, match="set trust_remote_code = true"):
        Producer(settings, stack.app(), stack.ledger())
