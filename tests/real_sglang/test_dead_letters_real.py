"""A request the real SGLang refuses becomes a dead letter carrying the server's own words:
a real Celery worker, a real Redis and the real server, as `datagen run` and `datagen dead`
show them to an operator."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import Stack, write_jsonl
from sglang_fixture import RealServer

from cli.stack import REPO

# SGLang 0.5.23's schema decoder refuses a sampling key it does not know; OpenAI's name for
# max_new_tokens is the likeliest one to be configured by mistake.
REFUSED_KEY = "max_tokens"


def datagen(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=REPO,
                          env=dict(os.environ, **stack.env), capture_output=True, text=True,
                          timeout=300)


def test_a_request_the_real_server_refuses_is_a_dead_letter_in_its_words(
        stack: Stack, real_sglang_context: RealServer) -> None:
    # Given: prompts for the real server (the stack's tokenizer is the one it serves), with a
    # sampling key it refuses, and one worker
    write_jsonl(stack.tmp / "partition" / "B1.jsonl",
                [{"id": f"B1-{i}", "prompt": f"question number {i}"} for i in range(3)])
    stack.configure(data_dir=str(stack.tmp / "partition"), server_url=real_sglang_context.url,
                    short_concurrency=2, short_max_tokens=4, max_retries=0,
                    sampling_params={"temperature": 0, REFUSED_KEY: 4})
    stack.worker("short")
    stack.wait_workers(1)

    # When: the run goes to its end
    run = datagen(stack, "run", "--interval", "0.3")

    # Then: every sample is dead with the server's message, word for word
    assert run.returncode == 0, run.stderr[-3000:]
    reasons = stack.ledger().dead("B1")
    assert sorted(reasons) == ["B1-0", "B1-1", "B1-2"]
    expected = f"unknown field `{REFUSED_KEY}`, expected one of `max_new_tokens`, `stop`, "
    assert all(reason.startswith(expected) and reason.endswith("`watermark`, `choice`")
               for reason in reasons.values()), reasons
    listing = datagen(stack, "dead")
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout.splitlines()[0] == "B1: 3 dead"
    assert expected in listing.stdout
