"""What the producer reads from the server, and the prompts it keeps from it: against a
simulator launched as SGLang 0.5.23 is by default (``/server_info`` ``context_length``
null; the limits in ``max_req_input_len`` and ``/v1/models`` ``max_model_len``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import redis
import requests
from conftest import CLI_HANG_S, Stack, write_jsonl

from cli.stack import REPO
from datagen.generation.follower import follow
from datagen.generation.records import iter_records, records_dir
from datagen.keys import queue_lists
from producers.producer import Producer

CONTEXT = 64  # the model's own (max_position_embeddings); max_req_input_len is 58


def prompts_of_lengths(stack: Stack, lengths: range) -> dict[int, str]:
    """A prompt text per token count of its chat-templated ids, for the counts in range."""
    found: dict[int, str] = {}
    for words in range(1, 100):
        for tail in ("", "x", "xy", "x y"):
            text = "word " * words + tail
            n = len(stack.encoder.encode([{"role": "user", "content": text}]))
            if n in lengths:
                found.setdefault(n, text)
    assert set(found) == set(lengths), sorted(found)
    return found


def test_a_default_launched_server_gives_its_limits_and_refused_prompts_are_skipped(
        stack: Stack) -> None:
    # Given: a server launched without --context-length, and prompts from well under its
    # max_req_input_len (58) to its context length (64); no context_length setting
    stack.start_simulator("--max-position-embeddings", str(CONTEXT), "--lengths", "fixed:500",
                          "--decode-step-s", "0.001")
    info = requests.get(f"{stack.sim_url}/server_info", timeout=10).json()
    assert info["context_length"] is None and info["max_req_input_len"] == CONTEXT - 6
    texts = prompts_of_lengths(stack, range(50, CONTEXT + 1))
    write_jsonl(stack.tmp / "partition" / "B1.jsonl",
                [{"id": f"n{n}", "prompt": t} for n, t in texts.items()])
    settings = stack.configure(data_dir=str(stack.tmp / "partition"), short_concurrency=3,
                               short_max_tokens=100, long_threshold_tokens=1000,
                               keep_truncated=True)
    stack.worker("short")
    stack.wait_workers(1)

    # When: the producer runs, with nothing to tell it the context length but the server
    ledger = stack.ledger()
    [report] = Producer(settings, stack.app(), ledger).run()
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)

    # Then: the prompts the server would refuse (>= 58 tokens) are in the bad report, each
    # with its reason; every other one was accepted and filled the context to two short (the
    # producer asks for context - prompt - 1 tokens; SGLang's scheduler, and so the
    # simulator, lowers that to max_req_len - prompt - 1 = context - prompt - 2)
    bad = (Path(settings.output_dir) / "reports" / "B1.bad.txt").read_text().splitlines()
    assert len(bad) == len(report.bad) == CONTEXT + 1 - 58
    assert sum("max_req_input_len" in line for line in bad) == CONTEXT - 1 - 58
    assert sum("leaves no room" in line for line in bad) == 2  # 63 and 64 tokens
    done = [r for r in iter_records(records_dir(settings.output_dir, "B1"))
            if isinstance(r, dict)]
    assert sorted(r["prompt_tokens"] for r in done) == list(range(50, 58))
    assert all(r["prompt_tokens"] + r["completion_tokens"] == CONTEXT - 2 for r in done)
    assert ledger.dead("B1") == {}
    assert not [e for e in stack.sim_log() if e["event"] == "reject"]


def test_a_context_length_setting_over_the_servers_is_refused_and_nothing_enqueued(
        stack: Stack) -> None:
    # Given: a default-launched server of context 64, and a setting that claims more
    stack.start_simulator("--max-position-embeddings", str(CONTEXT))
    write_jsonl(stack.tmp / "partition" / "B1.jsonl", [{"id": "s0", "prompt": "question"}])
    stack.configure(data_dir=str(stack.tmp / "partition"), context_length=4096)

    # When: the producer starts
    result = subprocess.run([sys.executable, "-m", "cli.main", "produce"], cwd=REPO,
                            env=dict(os.environ, **stack.env), capture_output=True, text=True,
                            timeout=CLI_HANG_S)

    # Then: one line naming the setting and both values, and nothing queued
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert "context_length" in line and "4096" in line and "64" in line, line
    assert "max_model_len" in line and "nothing enqueued" in line
    client = redis.Redis.from_url(stack.redis_url)
    assert sum(client.llen(q) for q in queue_lists("short") + queue_lists("long")) == 0
    assert client.hlen("dg:ds:B1:pending") == 0


def test_a_smaller_context_length_setting_lowers_the_servers(stack: Stack) -> None:
    # Given: a server launched with --context-length 8192 (shown in /server_info), and a
    # setting of 64
    stack.start_simulator("--context-length", "8192")
    write_jsonl(stack.tmp / "partition" / "B1.jsonl", [{"id": "s0", "prompt": "question"}])
    settings = stack.configure(data_dir=str(stack.tmp / "partition"), context_length=CONTEXT)

    # When / Then: the producer sizes prompts to the setting, inputs to 6 less
    producer = Producer(settings, stack.app(), stack.ledger())
    assert (producer.limits.context_length, producer.limits.max_input_tokens) == (64, 58)
