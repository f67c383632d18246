"""The producer: classification, clamping, bad-input reports, and what it enqueues."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis
import zstandard
from conftest import write_jsonl

from cli.stack import REPO
from config.settings import Settings
from datagen.client import Limits
from datagen.errors import ServerUnavailable
from datagen.keys import queue_lists
from datagen.redis_server import free_port
from producers.producer import Plan, classify, fit_window, rendering_kind


def test_classify_by_prompt_length_against_the_threshold() -> None:
    s = Settings(long_threshold_tokens=100, short_max_tokens=50, long_max_tokens=80)
    assert classify(s, 100, None) == Plan("short", 50)
    assert classify(s, 101, None) == Plan("long", 80)


def test_max_new_tokens_is_clamped_to_the_context_or_the_prompt_skipped() -> None:
    s = Settings(long_threshold_tokens=100, short_max_tokens=50, long_max_tokens=80)
    # SGLang refuses prompt + max_new_tokens > context; the clamp keeps one token spare
    assert classify(s, 90, Limits(120, 114, "t")) == Plan("short", 29)
    assert classify(s, 150, Limits(400, 394, "t")) == Plan("long", 80)
    assert classify(s, 113, Limits(120, 114, "t")) == Plan("long", 6)
    assert classify(s, 118, Limits(120, 119, "t")) == Plan("long", 1)
    for prompt in (119, 120):
        reason = classify(s, prompt, Limits(120, 200, "t"))
        assert isinstance(reason, str) and f"{prompt} tokens" in reason and "no room" in reason


def test_a_prompt_at_or_over_max_req_input_len_is_skipped_with_the_reason() -> None:
    # SGLang 0.5.23 refuses an input >= max_req_input_len (context - 6) with a 400, though
    # the context would leave room: context - 6 ... context - 2 tokens were sent before.
    s = Settings(long_threshold_tokens=100, short_max_tokens=50, long_max_tokens=80)
    for prompt in range(114, 119):
        reason = classify(s, prompt, Limits(120, 114, "t"))
        assert isinstance(reason, str) and f"{prompt} tokens" in reason
        assert "fewer than 114" in reason and "max_req_input_len" in reason


def test_the_window_caps_max_new_tokens_or_skips_a_prompt_it_leaves_no_room() -> None:
    s = Settings(train_max_length=2048, min_trainable_tokens=64)
    assert fit_window(s, Plan("short", 10240), 1075, 1) == Plan("short", 973)
    assert fit_window(s, Plan("short", 500), 1075, 1) == Plan("short", 500)
    assert fit_window(s, Plan("short", 10240), 1984, 1) == Plan("short", 64)
    for fixed in (1985, 2048, 5000):
        reason = fit_window(s, Plan("long", 16384), fixed, 1)
        assert isinstance(reason, str) and "min_trainable_tokens 64" in reason
        assert f"({fixed} tokens)" in reason
    # off: the whole response, whatever the window
    off = s.replace(cap_to_window=False)
    assert fit_window(off, Plan("long", 16384), 5000, 1) == Plan("long", 16384)


def test_produce_sends_nothing_the_window_cannot_train_and_says_so(
        tmp_path: Path, redis_url: str, tokenizer_dir: Path) -> None:
    # Given: a window of 100 tokens; one prompt far over it, one short
    long_prompt = " ".join(f"w{i}" for i in range(300))
    write_jsonl(tmp_path / "partition" / "B1.jsonl", [
        {"id": "short", "prompt": "question"}, {"id": "too-long", "prompt": long_prompt}])
    # When: the producer runs
    result = _produce(tmp_path, redis_url, tokenizer_dir, DATAGEN_TRAIN_MAX_LENGTH="100",
                      DATAGEN_SHORT_MAX_TOKENS="500", DATAGEN_CONTEXT_LENGTH="4000")
    # Then: the long prompt is not sent, with its reason in the report (not bad input),
    # and the short one may generate only what the window leaves after its prompt
    assert result.returncode == 0, result.stderr
    report = (tmp_path / "out" / "reports" / "B1.bad.txt").read_text()
    assert "leaves 0 of train_max_length 100" in report and "min_trainable_tokens" in report
    assert "1 enqueued, 0 skipped as bad input, 1 for the window" in result.stdout
    row = next(line for line in result.stdout.splitlines() if line.startswith("B1 "))
    assert row.split()[-2:] == ["1", "100%"]
    pending = redis.Redis.from_url(redis_url, decode_responses=True).hgetall(
        "dg:ds:B1:pending")
    job = json.loads(pending["short"])
    assert list(pending) == ["short"] and job["window"] == 100
    assert job["max_new_tokens"] == 100 - job["prompt_tokens"] < 500


def test_with_the_cap_off_produce_says_what_the_window_will_drop_and_cut(
        tmp_path: Path, redis_url: str, tokenizer_dir: Path) -> None:
    # Given: the same window of 100 tokens, cap_to_window off: three prompts, one longer
    # than the window, two short whose 500-token caps reach past it
    long_prompt = " ".join(f"w{i}" for i in range(300))
    write_jsonl(tmp_path / "partition" / "B1.jsonl", [
        {"id": "a", "prompt": "question"}, {"id": "b", "prompt": "another question"},
        {"id": "too-long", "prompt": long_prompt}])
    result = _produce(tmp_path, redis_url, tokenizer_dir, DATAGEN_TRAIN_MAX_LENGTH="100",
                      DATAGEN_CAP_TO_WINDOW="false", DATAGEN_SHORT_MAX_TOKENS="500",
                      DATAGEN_LONG_MAX_TOKENS="500", DATAGEN_CONTEXT_LENGTH="4000")
    # Then: all three are sent, and before anything runs the table says what prepare will do
    assert result.returncode == 0, result.stderr
    assert "3 enqueued" in result.stdout
    assert ("B1: train_max_length will drop 1 of the samples enqueued (the prompt fills it) "
            "and may cut 2 (prompt + max_new_tokens past it)") in result.stdout


def test_nothing_is_enqueued_while_the_context_length_is_unknown(
        tmp_path: Path, redis_url: str, tokenizer_dir: Path) -> None:
    # Given: no server at server_url and no context_length setting
    write_jsonl(tmp_path / "partition" / "B1.jsonl", [{"id": "s0", "prompt": "question"}])
    env = dict(os.environ, DATAGEN_REDIS_URL=redis_url, DATAGEN_OUTPUT_DIR=str(tmp_path / "out"),
               DATAGEN_TOKENIZER_PATH=str(tokenizer_dir),
               DATAGEN_SERVER_URL=f"http://127.0.0.1:{free_port()}")
    result = subprocess.run([sys.executable, "-m", "cli.main", "produce", "--data-dir",
                             str(tmp_path / "partition")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    # Then: one clear line naming the settings, and nothing queued
    assert result.returncode == 2, result.stderr
    assert "context length unknown" in result.stderr and "context_length" in result.stderr
    client = redis.Redis.from_url(redis_url)
    assert _queued(client) == 0 and client.hlen("dg:ds:B1:pending") == 0


def _produce(tmp: Path, redis_url: str, tokenizer_dir: Path, *extra: str, **env_extra: str
             ) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DATAGEN_REDIS_URL=redis_url, DATAGEN_OUTPUT_DIR=str(tmp / "out"),
               DATAGEN_TOKENIZER_PATH=str(tokenizer_dir), DATAGEN_CONTEXT_LENGTH="400",
               DATAGEN_LONG_THRESHOLD_TOKENS="100", DATAGEN_SHORT_MAX_TOKENS="64",
               DATAGEN_LONG_MAX_TOKENS="64")
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "cli.main", "produce", "--data-dir",
                           str(tmp / "partition"), *extra], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_bad_input_is_reported_with_file_line_and_reason_and_the_rest_runs(
        tmp_path: Path, redis_url: str, tokenizer_dir: Path) -> None:
    # Given: a dataset with one good line and one line of each bad kind
    long_prompt = " ".join(f"w{i}" for i in range(600))
    bad = write_jsonl(tmp_path / "partition" / "B1_bad" / "a.jsonl", [
        {"id": "ok-1", "prompt": "fine"},
        "{not json",
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"id": "too-long", "prompt": long_prompt},
        {"id": "ok-2", "messages": [{"role": "user", "content": "also fine"}]},
    ])
    with open(bad, "ab") as fh:
        fh.write(b'{"prompt": "caf\xe9"}\n')
    write_jsonl(tmp_path / "partition" / "B2_good.jsonl", [{"prompt": "hello"}])

    # When: the producer runs
    result = _produce(tmp_path, redis_url, tokenizer_dir)

    # Then: exit status 3, a summary with the count, and a per-dataset report
    assert result.returncode == 3, result.stderr
    assert "3 enqueued, 5 skipped as bad input" in result.stdout
    report = (tmp_path / "out" / "reports" / "B1_bad.bad.txt").read_text().splitlines()
    assert len(report) == 5
    expect = {2: "invalid JSON", 3: "empty", 4: "unknown role 'wizard'", 5: "context length",
              7: "UTF-8"}
    for line_no, words in expect.items():
        hit = [r for r in report if r.startswith(f"{bad}:{line_no}:")]
        assert hit and words in hit[0], (line_no, report)
    pending = redis.Redis.from_url(redis_url, decode_responses=True).hkeys("dg:ds:B1_bad:pending")
    assert sorted(pending) == ["ok-1", "ok-2"]


def test_a_second_producer_run_enqueues_only_what_is_not_queued_or_done(
        tmp_path: Path, redis_url: str, tokenizer_dir: Path) -> None:
    write_jsonl(tmp_path / "partition" / "B1.jsonl",
                [{"id": f"s{i}", "prompt": f"question {i}"} for i in range(5)])
    first = _produce(tmp_path, redis_url, tokenizer_dir)
    assert first.returncode == 0, first.stderr
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    # Fresh work waits at the lowest priority: work that comes back goes ahead of it
    assert client.llen(queue_lists("short")[-1]) == _queued(client) == 5
    # One sample is done meanwhile; two more prompts are added to the dataset.
    client.hset("dg:ds:B1:done", "s0", "rid 10")
    with open(tmp_path / "partition" / "B1.jsonl", "a") as fh:
        for i in (5, 6):
            fh.write(json.dumps({"id": f"s{i}", "prompt": f"question {i}"}) + "\n")
    second = _produce(tmp_path, redis_url, tokenizer_dir)
    assert second.returncode == 0, second.stderr
    assert _queued(client) == 7
    assert "B1" in second.stdout and " 2 " in second.stdout.splitlines()[1]


def test_a_dataset_in_parquet_gz_and_zst_resumes_by_sample_id_in_any_form(
        tmp_path: Path, redis_url: str, tokenizer_dir: Path) -> None:
    # Given: a dataset as a parquet file, a .jsonl.gz and a .jsonl.zst, rows without ids
    # (their ids are digests of their messages), one bad line in the .zst
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(7)]
    folder = tmp_path / "partition" / "B1"
    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:3]), folder / "a.parquet")
    (folder / "b.jsonl.gz").write_bytes(gzip.compress(_lines(rows[3:5])))
    (folder / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        _lines(rows[5:6]) + b"{not json\n"))
    # When: the producer runs
    first = _produce(tmp_path, redis_url, tokenizer_dir)
    # Then: every good row is queued, the bad line reported by file and line
    assert first.returncode == 3, first.stderr
    report = (tmp_path / "out" / "reports" / "B1.bad.txt").read_text()
    assert report.startswith(f"{folder / 'c.jsonl.zst'}:2: invalid JSON")
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    queued = set(client.hkeys("dg:ds:B1:pending"))
    assert len(queued) == _queued(client) == 6
    # Given: one sample done meanwhile, and the dataset re-published as one parquet file
    # (rows in another order, one row added, the bad line mended)
    client.hset("dg:ds:B1:done", sorted(queued)[0], "rid 10")
    shutil.rmtree(folder)
    pq.write_table(pa.Table.from_pylist(rows[::-1]), tmp_path / "partition" / "B1.parquet")
    # When: the producer runs again
    second = _produce(tmp_path, redis_url, tokenizer_dir)
    # Then: only the added row is new: samples are known by id, never by file or position
    assert second.returncode == 0, second.stderr
    assert _queued(client) == 7
    (added,) = set(client.hkeys("dg:ds:B1:pending")) - queued
    assert json.loads(client.hget("dg:ds:B1:pending", added))["sample"] == added


def _lines(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def test_regenerate_all_is_refused_up_front_for_a_template_that_rewrites_earlier_turns(
        tmp_path: Path, redis_url: str, tokenizer_dir: Path) -> None:
    # Given: a tokenizer whose template trims every turn's text (Llama-3's way), so a
    # generated answer would not come out verbatim in the next turn's prompt
    trimming = shutil.copytree(tokenizer_dir, tmp_path / "tok")
    (trimming / "chat_template.jinja").write_text(
        "{%- for m in messages -%}{{- '<' + m['role'] + '>' + m['content'] | trim -}}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<assistant>' -}}{%- endif -%}")
    write_jsonl(tmp_path / "partition" / "B1.jsonl", [{"id": "s0", "messages": [
        {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"}]}])
    # When: the producer runs with regenerate = "all"
    result = _produce(tmp_path, redis_url, tokenizer_dir, DATAGEN_REGENERATE="all",
                      DATAGEN_TOKENIZER_PATH=str(trimming))
    # Then: one line naming the setting and the tokenizer, nothing queued
    assert result.returncode == 2, result.stderr
    assert "error: regenerate: regenerate = 'all' cannot be exact with this template" in \
        result.stderr and str(trimming) in result.stderr
    client = redis.Redis.from_url(redis_url)
    assert _queued(client) == 0 and client.hlen("dg:ds:B1:pending") == 0
    # ... while the tests' own template, which keeps turns as they are, runs
    result = _produce(tmp_path, redis_url, tokenizer_dir, DATAGEN_REGENERATE="all")
    assert result.returncode == 0, result.stderr
    assert _queued(client) == 1


def test_unknown_dataset_name_is_a_clear_error(tmp_path: Path, redis_url: str,
                                               tokenizer_dir: Path) -> None:
    write_jsonl(tmp_path / "partition" / "B1.jsonl", [{"prompt": "x"}])
    result = _produce(tmp_path, redis_url, tokenizer_dir, "--partition", "B9")
    assert result.returncode != 0
    assert "B9" in result.stderr and "B1" in result.stderr


def _queued(client: redis.Redis) -> int:
    return sum(client.llen(name) for name in queue_lists("short"))


def test_prompts_follow_the_rendering_of_the_server_kind_auto_asks_the_server() -> None:
    class VLLMModels(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = json.dumps({"data": [{"id": "m", "owned_by": "vllm"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    assert rendering_kind(Settings(server_kind="vllm")) == "vllm"
    server = ThreadingHTTPServer(("127.0.0.1", 0), VLLMModels)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert rendering_kind(Settings(server_kind="auto", server_url=url)) == "vllm"
    finally:
        server.shutdown()
    with pytest.raises(ServerUnavailable, match="server_kind 'auto'.*set server_kind"):
        rendering_kind(Settings(server_kind="auto", server_url=f"http://127.0.0.1:{free_port()}"))
