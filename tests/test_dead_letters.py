"""Dead letters in a real run: listed by reason, summed up at the end, cleared on success."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import CLI_HANG_S, Stack, write_jsonl

from cli.stack import REPO
from datagen.generation.follower import follow
from datagen.operations import dead
from datagen.operations.metrics import render_metrics
from producers.producer import Producer

SIM_CONTEXT = 400
MAX_NEW = 50
TOO_LONG = "The input (N tokens) is longer than the model's context length (N tokens)."
NO_ROOM = ("Requested token count exceeds the model's maximum context length of N tokens. "
           "You requested a total of N tokens: N tokens from the input messages and N tokens "
           "for the completion. Please reduce the number of tokens in the input messages or "
           "the completion to fit within the limit.")


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def datagen(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=REPO,
                          env=dict(os.environ, **stack.env), capture_output=True, text=True,
                          timeout=CLI_HANG_S)


def partition_with_oversized_prompts(stack: Stack) -> Path:
    """Six prompts that fit; two longer than the server's context, one that leaves no room."""
    words = {"B1-huge": 300, "B1-huger": 400, "B1-tight": 180}
    prompts = {sample: " ".join(["word"] * n) for sample, n in words.items()}
    lengths = {s: len(stack.encoder.encode(user(p))) for s, p in prompts.items()}
    assert lengths["B1-huge"] >= SIM_CONTEXT and lengths["B1-huger"] >= SIM_CONTEXT
    assert lengths["B1-tight"] < SIM_CONTEXT <= lengths["B1-tight"] + MAX_NEW
    rows = [{"id": f"B1-{i:03d}", "prompt": f"question number {i}"} for i in range(6)]
    rows += [{"id": sample, "prompt": text} for sample, text in prompts.items()]
    write_jsonl(stack.tmp / "partition" / "B1.jsonl", rows)
    return stack.tmp / "partition"


def test_datagen_dead_lists_the_dead_samples_by_reason_and_the_run_sums_them_up(
        stack: Stack) -> None:
    # Given: a server whose context is smaller than the producer believes, and one worker
    stack.start_simulator("--lengths", "fixed:30", "--decode-step-s", "0.002",
                          "--context-length", str(SIM_CONTEXT))
    served_by = stack.sim_url
    sized_for = stack.start_simulator(name="sim-producer")  # a larger one, read by the producer
    stack.configure(data_dir=str(partition_with_oversized_prompts(stack)),
                    short_concurrency=2, server_url=sized_for,
                    long_threshold_tokens=100_000, short_max_tokens=MAX_NEW)
    stack.worker("short", server_url=served_by)
    stack.wait_workers(1)

    # When: `datagen run` produces and follows the run to its end
    run = datagen(stack, "run", "--interval", "0.3")

    # Then: its summary names the two reasons, most frequent first
    assert run.returncode == 0, run.stderr[-3000:]
    summary = run.stdout[run.stdout.index("dead letters:"):].splitlines()
    assert summary[0].startswith("dead letters: 3 samples")
    # each reason shown as one sample had it (real numbers), grouped on the masked pattern
    assert summary[1].split(maxsplit=3)[:3] == ["2", "B1", "e.g."]
    assert dead.pattern(summary[1].split(maxsplit=3)[3]) == TOO_LONG
    assert summary[1].split(maxsplit=3)[3] == stack.ledger().dead("B1")["B1-huge"]
    assert dead.pattern(summary[2].split(maxsplit=2)[2]) == NO_ROOM

    # ... `datagen dead` lists them grouped, with each sample id
    listing = datagen(stack, "dead")
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert lines[0] == "B1: 3 dead"
    assert lines[1].split(maxsplit=2)[:2] == ["2", "e.g."]
    assert dead.pattern(lines[1].split(maxsplit=2)[2]) == TOO_LONG
    assert "B1-huge, B1-huger" in listing.stdout
    assert any(line.split(maxsplit=1)[0] == "1"
               and dead.pattern(line.split(maxsplit=1)[1]) == NO_ROOM for line in lines)

    # ... and its JSON carries the same, with every sample's full reason from the ledger
    rows = json.loads(datagen(stack, "dead", "B1", "--json").stdout)
    assert [(r["dataset"], r["dead"]) for r in rows] == [("B1", 3)]
    reasons = rows[0]["reasons"]
    assert [(g["reason"], g["count"], g["samples"]) for g in reasons] == [
        (TOO_LONG, 2, ["B1-huge", "B1-huger"]), (NO_ROOM, 1, ["B1-tight"])]
    ledger = stack.ledger()
    assert reasons[0]["example"] == ledger.dead("B1")["B1-huge"]
    assert ledger.snapshot("B1")["stats"]["samples"] == 6
    assert datagen(stack, "dead", "B9").returncode == 2


def run_producer(stack: Stack) -> int:
    ledger = stack.ledger()
    reports = Producer(stack.settings(), stack.app(), ledger).run()
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)
    return sum(r.enqueued for r in reports)


def test_a_dead_letter_clears_when_its_sample_later_succeeds(stack: Stack) -> None:
    # Given: a run whose first two requests fail with 500s, with no retries allowed
    url = stack.start_simulator("--lengths", "fixed:30", "--decode-step-s", "0.002")
    write_jsonl(stack.tmp / "partition" / "B1.jsonl",
                [{"id": f"B1-{i}", "prompt": f"question number {i}"} for i in range(8)])
    stack.configure(data_dir=str(stack.tmp / "partition"), short_concurrency=2, max_retries=0,
                    short_max_tokens=50)
    stack.set_fault(url, mode="error500", count=2)
    stack.worker("short")
    stack.wait_workers(1)
    assert run_producer(stack) == 8
    ledger = stack.ledger()
    died = ledger.dead("B1")
    assert len(died) == 2 and all("HTTP 500" in reason for reason in died.values())
    assert 'datagen_dead_letters{dataset="B1"} 2.0' in render_metrics(ledger)

    # When: the producer runs again (the server is fine now) and the two samples succeed
    assert run_producer(stack) == 2

    # Then: every sample is done and no dead letter is left: not in the ledger, not in
    # status, not in the listing, not in Prometheus
    assert ledger.snapshot("B1")["stats"]["samples"] == 8
    assert ledger.dead("B1") == {}
    assert ledger.snapshot("B1")["dead"] == 0
    assert dead.summary(dead.read(ledger)) == ""
    assert 'datagen_dead_letters{dataset="B1"} 0.0' in render_metrics(ledger)


def test_a_vllm_server_s_refusals_reach_the_dead_letters_in_its_own_words(
        stack: Stack) -> None:
    # Given: a worker on a vLLM server (the simulator's vLLM API, held beside the real vLLM
    # 0.32 in tests/real_vllm) whose context is smaller than the producer believes
    served_by = stack.start_simulator("--kind", "vllm", "--lengths", "fixed:30",
                                      "--decode-step-s", "0.002",
                                      "--context-length", str(SIM_CONTEXT))
    sized_for = stack.start_simulator(name="sim-producer")
    settings = stack.configure(data_dir=str(partition_with_oversized_prompts(stack)),
                               short_concurrency=2, server_url=sized_for,
                               long_threshold_tokens=100_000, short_max_tokens=MAX_NEW)
    stack.worker("short", server_url=served_by, server_kind="vllm")
    stack.wait_workers(1)

    # When: `datagen run` produces and follows the run to its end
    run = datagen(stack, "run", "--interval", "0.3")
    assert run.returncode == 0, run.stderr[-3000:]

    # Then: the two prompts longer than its context are dead with vLLM's text; the one that
    # leaves too little room is served and cut at the context (vLLM does not refuse it)
    died = stack.ledger().dead("B1")
    assert sorted(died) == ["B1-huge", "B1-huger"]
    assert {dead.pattern(text) for text in died.values()} == {
        "The decoder prompt (length N) is longer than the maximum model length of N. Make "
        "sure that `max_model_len` is no smaller than the number of text tokens."}
    # ... and the others are stored once each, their tokens counted once
    ledger = stack.ledger()
    recs = [json.loads(line) for path in (Path(settings.output_dir) / "records" / "B1"
                                          ).glob("*.jsonl")
            for line in path.read_text().splitlines()]
    assert sorted(r["id"] for r in recs) == [f"B1-{i:03d}" for i in range(6)] + ["B1-tight"]
    assert ledger.snapshot("B1")["tokens"] == sum(r["trainable_tokens"] for r in recs)
    tight = next(r for r in recs if r["id"] == "B1-tight")
    assert tight["finish_reason"] == {"type": "length", "length": tight["completion_tokens"]}
    assert len(tight["prompt_ids"]) + tight["completion_tokens"] == SIM_CONTEXT
