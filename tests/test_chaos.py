"""Faults caused for real: killed workers, redelivery, failing servers, Redis lost, bad disks.

Every test ends by checking the two invariants: nothing lost (every sample done,
dead-lettered with a reason, or not needed) and nothing counted twice (the counter
equals the sum of the merged records' tokens, one record per id).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from conftest import Stack, wait_until, write_jsonl

from cli.commands import follow
from cli.stack import REPO
from datagen.generation.merge import merge_dataset
from datagen.redis_server import free_port
from producers.producer import Producer

pytestmark = pytest.mark.chaos


def partition(root: Path, n: int, name: str = "B1") -> Path:
    write_jsonl(root / "partition" / f"{name}.jsonl",
                [{"id": f"{name}-{i:03d}", "prompt": f"question number {i}"} for i in range(n)])
    return root / "partition"


def owned_by(entry: dict[str, Any], proc: Any) -> bool:
    """Owner ids are host-pid-random, unique per process start."""
    return str(entry["worker"]).startswith(f"{socket.gethostname()}-{proc.pid}-")


def assert_exact_accounting(stack: Stack, settings: Any, dataset: str, expected: int) -> None:
    """Every sample stored once; the counter equals the merged records' tokens."""
    ledger = stack.ledger()
    done = ledger.committed(dataset)
    report = merge_dataset(settings.output_dir, dataset, done)
    merged = [json.loads(x) for x in Path(report.path).read_text().splitlines()]
    assert len(merged) == len({r["id"] for r in merged}) == expected
    snap = ledger.snapshot(dataset)
    assert snap["tokens"] == sum(r["completion_tokens"] for r in merged)
    assert snap["stats"]["samples"] == expected
    assert all(r["finish_reason"]["type"] != "abort" for r in merged)


def start(stack: Stack, settings: Any) -> Any:
    ledger = stack.ledger()
    Producer(settings, stack.app(), ledger).run()
    return ledger


def test_sigkilled_worker_loses_nothing_and_counts_nothing_twice(stack: Stack) -> None:
    # Given: two workers and requests that take a few seconds each
    stack.start_simulator("--lengths", "uniform:150:250", "--decode-step-s", "0.015")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 24)), short_concurrency=4,
                               short_max_tokens=400)
    victim = stack.worker("short", name="victim@%h")
    stack.worker("short", name="survivor@%h")
    stack.wait_workers(2)
    ledger = start(stack, settings)
    wait_until(lambda: sum(owned_by(e, victim)
                           for e in ledger.in_flight("B1").values()) >= 2, 30,
               what="the victim to have requests in flight")

    # When: the victim is killed with SIGKILL mid-request
    killed_at = time.time()
    victim.kill()
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)

    # Then: its samples were re-run by the survivor within a few leases, and counted once
    snap = ledger.snapshot("B1")
    assert snap["stats"]["reaped"] >= 2
    assert_exact_accounting(stack, settings, "B1", 24)
    restarts = [e["time"] for e in stack.sim_log() if e["event"] == "start"
                and e["time"] > killed_at]
    assert restarts and min(restarts) - killed_at < 4 * settings.lease_s + 5
    reruns = [e["time"] for e in stack.sim_log() if e["event"] == "start"]
    print(f"FIGURE kill: reaped={snap['stats']['reaped']} lease_s={settings.lease_s} "
          f"requests={len(reruns)} samples=24 duplicates_counted=0")


def test_short_visibility_timeout_does_not_run_any_sample_twice(stack: Stack) -> None:
    # Given: a visibility timeout far shorter than each request (REFERENCE §4)
    stack.start_simulator("--lengths", "fixed:120", "--decode-step-s", "0.03")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 12)), short_concurrency=3,
                               visibility_timeout_s=1, short_max_tokens=200)
    stack.worker("short")
    stack.worker("short")
    stack.wait_workers(2)
    # When: the run goes on for several visibility timeouts
    ledger = start(stack, settings)
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)
    # Then: the server saw exactly one request per sample
    starts = [e for e in stack.sim_log() if e["event"] == "start"]
    assert len(starts) == 12
    assert ledger.snapshot("B1")["stats"].get("duplicates", 0) == 0
    assert_exact_accounting(stack, settings, "B1", 12)


def set_fault(url: str, **spec: Any) -> None:
    requests.post(f"{url}/_sim/fault", json=spec, timeout=5).raise_for_status()


def test_server_errors_are_retried_and_bad_requests_dead_lettered(stack: Stack) -> None:
    # Given: a server whose context is smaller than the producer believes
    url = stack.start_simulator("--lengths", "fixed:30", "--decode-step-s", "0.002",
                                "--context-length", "400")
    part = partition(stack.tmp, 10)
    with open(part / "B1.jsonl", "a") as fh:
        fh.write(json.dumps({"id": "B1-huge", "prompt": " ".join(["word"] * 500)}) + "\n")
    settings = stack.configure(data_dir=str(part), short_concurrency=2, max_retries=3,
                               context_length=100_000, long_threshold_tokens=100_000,
                               short_max_tokens=50)
    # ... and that fails the next requests with 500s and connection resets
    set_fault(url, mode="error500", count=3)
    stack.worker("short")
    stack.wait_workers(1)
    ledger = start(stack, settings)
    wait_until(lambda: requests.get(f"{url}/_sim/fault", timeout=5).json()["mode"] == "none",
               30, what="the 500s to be used up")
    set_fault(url, mode="reset", count=2)
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)

    # Then: the 400 is dead-lettered with the server's message; all others are done
    dead = ledger.dead("B1")
    assert list(dead) == ["B1-huge"]
    assert "longer than the model's context length" in dead["B1-huge"]
    rejects = [e for e in stack.sim_log() if e["event"] == "reject" and e["status"] == 400]
    assert len(rejects) == 1  # a permanent error is not retried
    assert_exact_accounting(stack, settings, "B1", 10)


def test_a_read_timeout_aborts_the_request_on_the_server(stack: Stack) -> None:
    # Given: a server that is slow for a few seconds, longer than the read timeout
    url = stack.start_simulator("--lengths", "fixed:40", "--decode-step-s", "0.01")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 4)), short_concurrency=4,
                               read_timeout_s=1.5, short_max_tokens=100)
    set_fault(url, mode="slow", factor=20, duration_s=4)
    stack.worker("short")
    stack.wait_workers(1)
    # When: the first tries time out
    ledger = start(stack, settings)
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)
    # Then: each timed-out request was aborted on the server (no zombie decoding),
    # and the retries completed every sample
    log = stack.sim_log()
    aborted = {e["rid"] for e in log if e["event"] == "abort"}
    assert len(aborted) >= 4
    assert_exact_accounting(stack, settings, "B1", 4)


def test_a_server_down_for_a_while_does_not_burn_retries(stack: Stack) -> None:
    # Given: a running worker, only one retry allowed per sample, and a server that
    # answers 503 until the test says otherwise
    url = stack.start_simulator("--lengths", "fixed:20", "--decode-step-s", "0.002")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 6)), short_concurrency=3,
                               max_retries=1, short_max_tokens=50)
    worker = stack.worker("short")
    stack.wait_workers(1)
    set_fault(url, mode="down")
    # When: the run starts while it is down, and every slot has met the outage
    ledger = start(stack, settings)
    wait_until(lambda: len(_down_rejects(stack)) >= 3, 60, what="3 requests refused with 503")
    wait_until(lambda: worker.log_text().count("unhealthy: waiting for it") >= 3, 60,
               what="the worker to wait for the server")
    # ... and it stays down for many retry backoffs (0.2 s each) after that
    time.sleep(2.0)
    set_fault(url, mode="none")
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)

    # Then: the refusals came before any request ran, the worker waited them out,
    # and nothing was dead-lettered
    # (a retry sent while it was down would be a fourth 503, and dead with max_retries 1)
    rejects = _down_rejects(stack)
    assert len(rejects) == 3
    first_start = min(e["time"] for e in stack.sim_log() if e["event"] == "start")
    assert max(e["time"] for e in rejects) < first_start
    assert ledger.dead("B1") == {}
    print(f"FIGURE down: {len(rejects)} requests refused with 503, one per slot")
    assert_exact_accounting(stack, settings, "B1", 6)


def _down_rejects(stack: Stack) -> list[dict[str, Any]]:
    return [e for e in stack.sim_log() if e["event"] == "reject" and e["status"] == 503]


def test_redis_restarted_empty_is_rebuilt_from_the_records(stack: Stack,
                                                            redis_server: Any) -> None:
    # Given: a run that has stored some samples
    stack.start_simulator("--lengths", "uniform:40:80", "--decode-step-s", "0.01")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 30)), short_concurrency=3,
                               short_max_tokens=100)
    stack.worker("short")
    stack.wait_workers(1)
    ledger = start(stack, settings)
    wait_until(lambda: ledger.snapshot("B1")["stats"].get("samples", 0) >= 8, 60,
               what="some samples stored")

    # When: Redis restarts with nothing in it, then the operator runs `datagen recover`
    redis_server.restart(empty=True)
    env = dict(os.environ, **stack.env)
    result = subprocess.run([sys.executable, "-m", "cli.main", "recover"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "B1:" in result.stdout and "records" in result.stdout
    stack.wait_workers(1)
    follow(stack.ledger(), 0.3, app=stack.app(), timeout_s=120)

    # Then: counters, done-set and queue were rebuilt; every sample is there exactly once
    assert_exact_accounting(stack, settings, "B1", 30)


def test_sigterm_hands_in_flight_work_back(stack: Stack) -> None:
    # Given: a worker with long requests in flight and a 1 s shutdown grace
    stack.start_simulator("--lengths", "fixed:400", "--decode-step-s", "0.02")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 6)), short_concurrency=3,
                               short_max_tokens=500, shutdown_grace_s=1.0)
    first = stack.worker("short", name="first@%h")
    stack.wait_workers(1)
    ledger = start(stack, settings)
    wait_until(lambda: len(ledger.in_flight("B1")) == 3, 30, what="3 requests in flight")

    # When: it gets SIGTERM
    first.signal(signal.SIGTERM)
    first.proc.wait(timeout=30)

    # Then: it aborted its requests, re-enqueued their samples, and exited; a new
    # worker finishes the run with no partial record stored
    assert ledger.snapshot("B1")["stats"].get("samples", 0) == 0
    assert ledger.in_flight("B1") == {}
    stack.worker("short", name="second@%h")
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)
    assert_exact_accounting(stack, settings, "B1", 6)


def test_an_unwritable_output_folder_fails_loudly_and_counts_nothing(stack: Stack) -> None:
    # Given: the records folder cannot be created (a file stands in its way)
    stack.start_simulator("--lengths", "fixed:20", "--decode-step-s", "0.002")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 3)), short_concurrency=1,
                               short_max_tokens=50)
    out = Path(settings.output_dir)
    out.mkdir(parents=True)
    (out / "records").write_text("not a folder")
    proc = stack.worker("short")
    stack.wait_workers(1)
    ledger = start(stack, settings)

    # When: the worker tries to store its samples
    wait_until(lambda: "cannot write record" in proc.log_text(), 30, what="a loud error")
    # Then: nothing is counted, and the samples wait as pending work
    assert ledger.snapshot("B1")["tokens"] == 0
    assert len(ledger.pending("B1")) == 3

    # And once the disk is fixed, a sweep finishes the run
    (out / "records").unlink()
    follow(ledger, 0.3, app=stack.app(), timeout_s=60)
    assert_exact_accounting(stack, settings, "B1", 3)


def test_ids_and_names_from_the_data_cannot_write_outside_the_output(stack: Stack) -> None:
    # Given: record ids that look like paths
    stack.start_simulator("--lengths", "fixed:10", "--decode-step-s", "0.002")
    part = stack.tmp / "partition"
    write_jsonl(part / "B1.jsonl", [{"id": "../../escape", "prompt": "a"},
                                    {"id": "/etc/passwd", "prompt": "b"}])
    settings = stack.configure(data_dir=str(part), short_concurrency=2, short_max_tokens=20)
    stack.worker("short")
    stack.wait_workers(1)
    ledger = start(stack, settings)
    follow(ledger, 0.3, app=stack.app(), timeout_s=60)
    # Then: both are stored as data inside the output folder, and nothing escaped it
    assert_exact_accounting(stack, settings, "B1", 2)
    outside = [p for p in stack.tmp.rglob("*") if "escape" in p.name]
    assert outside == []
    # ... and a dataset named like a path is refused before anything runs
    env = dict(os.environ, **stack.env)
    result = subprocess.run([sys.executable, "-m", "cli.main", "produce", "--partition",
                             "../../etc"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "../../etc" in result.stderr


def test_connection_refused_while_the_server_restarts_is_waited_out(stack: Stack) -> None:
    # Given: a server on a fixed port, and only one retry allowed per sample
    port = free_port()
    args = ("--port", str(port), "--lengths", "fixed:30", "--decode-step-s", "0.01")
    stack.start_simulator(*args)
    settings = stack.configure(data_dir=str(partition(stack.tmp, 8)), short_concurrency=2,
                               max_retries=1, short_max_tokens=60)
    stack.worker("short")
    stack.wait_workers(1)
    ledger = start(stack, settings)
    wait_until(lambda: ledger.snapshot("B1")["stats"].get("samples", 0) >= 1, 30,
               what="a first sample")
    # When: the server process dies (connections refused) and comes back 4 s later
    stack.sim.kill()
    time.sleep(4)
    stack.sim = None
    stack.start_simulator(*args, name="simulator-again")
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)
    # Then: nothing was dead-lettered and every sample is stored once
    assert ledger.dead("B1") == {}
    assert_exact_accounting(stack, settings, "B1", 8)


def test_a_full_server_queue_is_retried(stack: Stack) -> None:
    # Given: a server that queues at most one request beyond the one it runs
    stack.start_simulator("--lengths", "fixed:40", "--decode-step-s", "0.005",
                          "--max-running-requests", "1", "--max-queued-requests", "1")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 8)), short_concurrency=4,
                               short_max_tokens=60, max_retries=8)
    stack.worker("short")
    stack.wait_workers(1)
    ledger = start(stack, settings)
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)
    # Then: some requests met 503 "queue is full", and all were retried to completion
    full = [e for e in stack.sim_log() if e["event"] == "reject" and e["status"] == 503]
    assert full
    assert ledger.dead("B1") == {}
    assert_exact_accounting(stack, settings, "B1", 8)


@pytest.mark.parametrize("keep", [True, False])
def test_truncated_responses_are_recorded_and_kept_or_dead_lettered(stack: Stack,
                                                                    keep: bool) -> None:
    # Given: responses longer than max_new_tokens
    stack.start_simulator("--lengths", "fixed:100", "--decode-step-s", "0.001")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 4)), short_concurrency=2,
                               short_max_tokens=50, keep_truncated=keep)
    stack.worker("short")
    stack.wait_workers(1)
    ledger = start(stack, settings)
    follow(ledger, 0.3, app=stack.app(), timeout_s=60)
    snap = ledger.snapshot("B1")
    if keep:
        # Then: stored, flagged truncated, counted
        assert snap["stats"]["truncated"] == 4 and snap["tokens"] == 200
        assert_exact_accounting(stack, settings, "B1", 4)
    else:
        # Then: dead-lettered with the reason, not counted
        assert snap["tokens"] == 0 and len(ledger.dead("B1")) == 4
        assert all("truncated" in r for r in ledger.dead("B1").values())
