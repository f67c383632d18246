"""Secrets: a password-protected Redis, an SGLang API key, Flower's login — never in any output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import CLI_HANG_S, Stack, write_jsonl

from cli.stack import REPO
from config.settings import Settings, masked_url
from datagen.generation.follower import follow
from datagen.redis_server import RedisServer, free_port
from producers.producer import Producer

REDIS_PASSWORD = "redis-Pa55-9f3k"
API_KEY = "sk-sglang-7a1b2c3d"
FLOWER_AUTH = "ops:flower-Pa55-x81"


def test_masked_url_hides_the_password() -> None:
    assert masked_url(f"redis://:{REDIS_PASSWORD}@10.0.0.5:6379/0") == \
        "redis://:***@10.0.0.5:6379/0"
    assert masked_url("rediss://user:pw@host:6380/1") == "rediss://user:***@host:6380/1"
    public = Settings(api_key=API_KEY, flower_basic_auth=FLOWER_AUTH,
                      redis_url=f"redis://:{REDIS_PASSWORD}@h:1/0").public()
    assert API_KEY not in str(public) and REDIS_PASSWORD not in str(public)
    assert "flower-Pa55" not in str(public)


def test_no_secret_appears_in_logs_records_or_status(tmp_path: Path, tokenizer_dir: Path,
                                                       encoder: object) -> None:
    # Given: Redis with a password, a simulator requiring an API key, Flower credentials
    with RedisServer(workdir=tmp_path / "redis", password=REDIS_PASSWORD) as redis_server:
        stack = Stack(tmp_path, redis_server.url, tokenizer_dir, encoder)
        try:
            stack.start_simulator("--lengths", "fixed:20", "--decode-step-s", "0.002",
                                  "--api-key", API_KEY)
            write_jsonl(tmp_path / "partition" / "B1.jsonl",
                        [{"id": f"s{i}", "prompt": f"q {i}"} for i in range(6)])
            settings = stack.configure(data_dir=str(tmp_path / "partition"),
                                       api_key=API_KEY, flower_basic_auth=FLOWER_AUTH,
                                       short_concurrency=2, short_max_tokens=40)
            stack.worker("short")
            stack.wait_workers(1)
            # When: a run goes through (the API key is accepted: samples are stored)
            ledger = stack.ledger()
            Producer(settings, stack.app(), ledger).run()
            follow(ledger, 0.3, app=stack.app(), timeout_s=90)
            assert ledger.snapshot("B1")["stats"]["samples"] == 6
            env = dict(os.environ, **stack.env)
            outputs = [subprocess.run([sys.executable, "-m", "cli.main", cmd], cwd=REPO,
                                      env=env, capture_output=True, text=True, timeout=CLI_HANG_S)
                       for cmd in ("status", "config", "merge")]
        finally:
            stack.stop()
    # Then: no file the run wrote and no command output holds any of the secrets
    texts = [o.stdout + o.stderr for o in outputs]
    for path in tmp_path.rglob("*"):
        if path.is_file() and "redis" not in path.parts[-2:] and path.suffix != ".conf":
            texts.append(path.read_text(errors="replace"))
    assert "***" in outputs[1].stdout  # config shows that secrets exist, masked
    # The worker's banner names the broker, masked: proof that the logs were scanned.
    assert any(":**@127.0.0.1" in t for t in texts)
    for secret in (REDIS_PASSWORD, API_KEY, FLOWER_AUTH.split(":")[1]):
        leaks = [t[:200] for t in texts if secret in t]
        assert not leaks, f"{secret!r} leaked"


def test_an_unreachable_redis_is_named_by_its_setting_with_the_password_masked() -> None:
    url = f"redis://:s3cret-word@127.0.0.1:{free_port()}/0"
    result = subprocess.run([sys.executable, "-m", "cli.main", "status"], cwd=REPO,
                            env=dict(os.environ, DATAGEN_REDIS_URL=url), capture_output=True,
                            text=True, timeout=CLI_HANG_S)
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert "cannot reach Redis at redis_url redis://:***@127.0.0.1:" in line
    assert "s3cret-word" not in result.stderr + result.stdout
