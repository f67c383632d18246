"""Celery's per-task lines on the generation queues at DEBUG only (workers/task_log.py),
against a real Redis, a real worker and the simulator."""

from __future__ import annotations

import logging
import re

from conftest import Stack, wait_until, write_jsonl

from datagen import keys
from producers.producer import Producer
from workers.task_log import per_task_lines_quieted

RECEIVED = re.compile(r"Task datagen\.generate\[[^\]]+\] received")
SUCCEEDED = re.compile(r"Task datagen\.generate\[[^\]]+\] succeeded in")


def test_only_generation_workers_above_debug_are_quieted() -> None:
    assert per_task_lines_quieted({"short"}, logging.INFO, False)
    assert per_task_lines_quieted({"short", "long"}, logging.WARNING, False)
    assert not per_task_lines_quieted({"short"}, logging.INFO, True)  # log_each_task
    assert not per_task_lines_quieted({"short"}, logging.DEBUG, False)
    assert not per_task_lines_quieted({"gpu"}, logging.INFO, False)
    assert not per_task_lines_quieted({"short", "gpu"}, logging.INFO, False)
    assert not per_task_lines_quieted(set(), logging.INFO, False)


def _run(stack: Stack, samples: int, **worker_settings: object) -> str:
    write_jsonl(stack.tmp / "partition" / "L1.jsonl",
                [{"id": f"l{i}", "prompt": f"Line {i}"} for i in range(samples)])
    settings = stack.configure(data_dir=str(stack.tmp / "partition"), short_concurrency=4,
                               short_max_tokens=16)
    worker = stack.worker("short", **worker_settings)
    stack.wait_workers(1)
    ledger = stack.ledger()
    Producer(settings, stack.app(), ledger).run()
    stats = keys.dataset_key("L1", keys.STATS)
    wait_until(lambda: int(ledger.r.hget(stats, "samples") or 0) >= samples, 180,
               what="every sample stored")
    worker.stop()
    return worker.log_text()


def test_a_short_worker_at_info_logs_no_line_per_task(stack: Stack) -> None:
    # Given: a short worker at the default --loglevel INFO
    stack.start_simulator("--lengths", "fixed:8", "--decode-step-s", "0.001")
    # When: it runs every sample of a dataset
    log = _run(stack, 12)
    # Then: every sample was stored, and Celery logged neither line of any of its tasks
    # (without task_log it logs both, 24 lines here), while the worker's own start-up did log
    assert "ready." in log
    assert not RECEIVED.search(log) and not SUCCEEDED.search(log), log[-2000:]


def test_log_each_task_keeps_both_lines_of_every_task(stack: Stack) -> None:
    # Given: the same worker with log_each_task on (what bench_budget counts runs by)
    stack.start_simulator("--lengths", "fixed:8", "--decode-step-s", "0.001")
    # When: it runs every sample of a dataset
    log = _run(stack, 12, log_each_task=True)
    # Then: one "received" and one "succeeded" line per task, as Celery logs them at INFO
    assert len(RECEIVED.findall(log)) == 12 and len(SUCCEEDED.findall(log)) == 12, log[-2000:]
