"""Enqueueing many prompts keeps Redis memory bounded and the producer's memory flat,
on the first run and on every run after it (a restart finds everything queued or done).

The full-size version (100,000 prompts of ~2K tokens) is `bench/bench_load.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import redis

from cli.stack import REPO

# 200 MB for 100,000 queued prompts (issue 4) is 2,000 bytes each.
MAX_REDIS_BYTES_PER_PROMPT = 2000
SMALL, LARGE = 2000, 10000

# One process per size: a first run (peak RSS, Redis bytes), then two re-runs, one with
# every sample queued and one with every sample done, each traced by tracemalloc (Python's
# own allocations, exact and the same on any machine, unlike RSS). Last, the same trace
# of the least a re-run must hold: the set of the sample ids, read with HKEYS.
PRODUCE_AND_MEASURE = """
import json, resource, tracemalloc
import redis
from config.settings import load_settings
from datagen import keys
from datagen.celery_app import make_app
from datagen.generation.ledger import Ledger
from producers.producer import Producer

def traced_peak(fn):
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

s = load_settings()
r = redis.Redis.from_url(s.redis_url)
producer = Producer(s, make_app(s), Ledger.from_settings(s))
def enqueued():
    return sum(x.enqueued for x in producer.run())
before = r.info("memory")["used_memory"]
out = {"enqueued": enqueued(), "redis_bytes": r.info("memory")["used_memory"] - before,
       "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
out["queued_again"], out["rerun_queued"] = traced_peak(enqueued)
out["redis_bytes_rerun"] = r.info("memory")["used_memory"] - before - out["redis_bytes"]
# Every queued sample done instead (what a restart after the run finds); values unread.
r.rename(keys.dataset_key("B1", keys.PENDING), keys.dataset_key("B1", keys.DONE))
out["done_again"], out["rerun_done"] = traced_peak(enqueued)
out["ids"], out["id_set"] = traced_peak(
    lambda: len(set(Ledger.from_settings(s).done_ids("B1"))))
print(json.dumps(out))
"""


def _partition(root: Path, n: int) -> Path:
    folder = root / "partition" / "B1"
    folder.mkdir(parents=True)
    with open(folder / "a.jsonl", "w") as fh:
        for i in range(n):
            words = " ".join(f"w{(i * 7 + k) % 997}" for k in range(120))
            fh.write(json.dumps({"id": f"s{i:07d}", "prompt": f"{words} {i}"}) + "\n")
    return root / "partition"


def _produce(tmp: Path, n: int, redis_url: str, tokenizer_dir: Path) -> dict[str, Any]:
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
    # Given/When: a first run and two re-runs (all queued, all done) at two sizes
    small = _produce(tmp_path, SMALL, redis_url, tokenizer_dir)
    large = _produce(tmp_path, LARGE, redis_url, tokenizer_dir)
    print(f"FIGURE load: small {small} large {large}")
    for got, n in ((small, SMALL), (large, LARGE)):
        assert (got["enqueued"], got["queued_again"], got["done_again"]) == (n, 0, 0)
        assert got["ids"] == n

    # Then: a queued prompt costs Redis little, and a re-run adds nothing to Redis
    per_prompt = large["redis_bytes"] / large["enqueued"]
    assert per_prompt < MAX_REDIS_BYTES_PER_PROMPT, per_prompt
    assert large["redis_bytes_rerun"] < MAX_REDIS_BYTES_PER_PROMPT * 10, large
    # ... five times the prompts, nearly the same peak memory: the first run streams
    growth_mb = (large["maxrss_kb"] - small["maxrss_kb"]) / 1024
    assert growth_mb < 25, growth_mb
    # ... and a re-run holds no more per sample than its id: its growth with the number of
    # samples stays within twice that of the bare id set (payloads or prompts would not)
    id_growth = large["id_set"] - small["id_set"]
    for rerun in ("rerun_queued", "rerun_done"):
        growth = large[rerun] - small[rerun]
        assert growth <= 2 * id_growth, (rerun, growth, id_growth)
