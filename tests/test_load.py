"""Enqueueing many prompts keeps Redis memory bounded and the producer's memory flat.

The full-size version (100,000 prompts of ~2K tokens) is `bench/bench_load.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import redis

from cli.stack import REPO

# 200 MB for 100,000 queued prompts (issue 4) is 2,000 bytes each.
MAX_REDIS_BYTES_PER_PROMPT = 2000

PRODUCE_AND_MEASURE = """
import json, resource, sys
import redis
from config.settings import load_settings
from datagen.celery_app import make_app
from datagen.generation.ledger import Ledger
from producers.producer import Producer
s = load_settings()
r = redis.Redis.from_url(s.redis_url)
before = r.info("memory")["used_memory"]
reports = Producer(s, make_app(s), Ledger.from_settings(s)).run()
after = r.info("memory")["used_memory"]
print(json.dumps({"enqueued": sum(x.enqueued for x in reports),
                  "redis_bytes": after - before,
                  "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def _partition(root: Path, n: int) -> Path:
    folder = root / "partition" / "B1"
    folder.mkdir(parents=True)
    with open(folder / "a.jsonl", "w") as fh:
        for i in range(n):
            words = " ".join(f"w{(i * 7 + k) % 997}" for k in range(120))
            fh.write(json.dumps({"id": f"s{i:07d}", "prompt": f"{words} {i}"}) + "\n")
    return root / "partition"


def _produce(tmp: Path, n: int, redis_url: str, tokenizer_dir: Path) -> dict[str, int]:
    redis.Redis.from_url(redis_url).flushall()
    env = dict(os.environ, DATAGEN_REDIS_URL=redis_url, DATAGEN_TOKENIZER_PATH=str(tokenizer_dir),
               DATAGEN_OUTPUT_DIR=str(tmp / f"out{n}"), DATAGEN_CONTEXT_LENGTH="32768",
               DATAGEN_DATA_DIR=str(_partition(tmp / f"p{n}", n)))
    out = subprocess.run([sys.executable, "-c", PRODUCE_AND_MEASURE], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_queued_prompts_cost_little_redis_memory_and_the_producer_stays_flat(
        tmp_path: Path, redis_url: str, tokenizer_dir: Path) -> None:
    small = _produce(tmp_path, 2000, redis_url, tokenizer_dir)
    large = _produce(tmp_path, 10000, redis_url, tokenizer_dir)
    assert small["enqueued"] == 2000 and large["enqueued"] == 10000
    per_prompt = large["redis_bytes"] / large["enqueued"]
    assert per_prompt < MAX_REDIS_BYTES_PER_PROMPT, per_prompt
    # Five times the prompts, nearly the same peak memory: the producer streams.
    growth_mb = (large["maxrss_kb"] - small["maxrss_kb"]) / 1024
    assert growth_mb < 25, growth_mb
