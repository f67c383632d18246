"""The run's Celery app with a generation task that does no work (bench_generate's floor).

The task sleeps for ``DATAGEN_BENCH_TASK_S`` seconds (a thread held as by a request in flight)
and counts itself with one INCR, so the benchmark knows when all have run. What a worker
costs per message then is Celery's and kombu's share alone: the consumer, the pool hand-off,
the events, the log lines.
"""

from __future__ import annotations

import os
import time

import redis

from config.settings import load_settings
from datagen.celery_app import GENERATE_TASK, make_app

COUNTER = "bench:noop:done"
settings = load_settings()
app = make_app(settings)
_client = redis.Redis.from_url(settings.redis_url)
_hold_s = float(os.environ.get("DATAGEN_BENCH_TASK_S", "0.4"))


@app.task(name=GENERATE_TASK)
def generate(**_payload: object) -> str:
    time.sleep(_hold_s)
    _client.incr(COUNTER)
    return "stored"
