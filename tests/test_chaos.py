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
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests
from conftest import CLI_HANG_S, Stack, wait_until, write_jsonl

from cli.stack import REPO, Process, child_env
from datagen import keys
from datagen.generation.follower import follow
from datagen.generation.merge import merge_dataset
from datagen.generation.records import Problem, RecordWriter, iter_records
from datagen.redis_server import free_port
from producers.producer import Producer

pytestmark = [pytest.mark.chaos]


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
    assert snap["tokens"] == sum(r["trainable_tokens"] for r in merged)
    assert snap["stats"]["samples"] == expected
    assert all(r["finish_reason"]["type"] != "abort" for r in merged)


def start(stack: Stack, settings: Any) -> Any:
    ledger = stack.ledger()
    Producer(settings, stack.app(), ledger).run()
    return ledger


def test_sigkilled_worker_loses_nothing_and_its_work_comes_back_ahead_of_the_backlog(
        stack: Stack) -> None:
    # Given: two workers, and a backlog far longer than a lease
    stack.start_simulator("--lengths", "uniform:40:60", "--decode-step-s", "0.01")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 80)), short_concurrency=4,
                               short_max_tokens=100)
    victim = stack.worker("short", name="victim@%h")
    stack.worker("short", name="survivor@%h")
    stack.wait_workers(2)
    ledger = start(stack, settings)
    wait_until(lambda: sum(owned_by(e, victim) for e in ledger.in_flight("B1").values()) >= 2,
               30, what="the victim to have requests in flight")

    # When: the victim is killed with SIGKILL mid-request
    lost = {s for s, e in ledger.in_flight("B1").items() if owned_by(e, victim)}
    victim.kill()
    killed_at = time.time()
    follow(ledger, 0.3, app=stack.app(), timeout_s=180)

    # Then: every sample is stored once, counted once
    assert ledger.snapshot("B1")["stats"]["reaped"] >= len(lost)
    assert_exact_accounting(stack, settings, "B1", 80)
    # ... and the lost samples ran again before the fresh backlog was through: each of
    # their counted requests started before the last fresh sample's did
    started = {e["rid"]: e["time"] for e in stack.sim_log() if e["event"] == "start"}
    counted = {sid: v.split(" ")[0] for sid, v in ledger.committed("B1").items()}
    rerun_at = [started[counted[sid]] for sid in lost]
    fresh_at = [started[rid] for sid, rid in counted.items()
                if sid not in lost and started[rid] > killed_at]
    assert min(rerun_at) > killed_at
    assert max(rerun_at) < max(fresh_at), (rerun_at, max(fresh_at))
    behind = sum(t > max(rerun_at) for t in fresh_at)
    print(f"FIGURE kill: {len(lost)} lost samples re-run "
          f"{max(rerun_at) - killed_at:.1f}s after the kill (lease_s={settings.lease_s}), "
          f"{behind} fresh samples still behind them")


def test_a_killed_workers_requests_start_again_within_a_lease_and_two_seconds(
        stack: Stack) -> None:
    # Given: two workers of 4 threads, a 6 s lease, and a backlog of 400 short requests
    # (~0.3 s each), far longer than the lease
    stack.start_simulator("--lengths", "uniform:20:40", "--decode-step-s", "0.01")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 400)), short_concurrency=4,
                               short_max_tokens=100, lease_s=6.0)
    victim = stack.worker("short", name="victim@%h")
    stack.worker("short", name="survivor@%h")
    stack.wait_workers(2)
    ledger = start(stack, settings)
    wait_until(lambda: sum(owned_by(e, victim) for e in ledger.in_flight("B1").values()) >= 2,
               30, what="the victim to have requests in flight")

    # When: the victim is SIGKILLed; its requests' lease deadlines are read from the ledger
    # once it is dead (nothing renews them after)
    victim.kill()
    killed_at = time.time()
    lost = {s: e["rid"] for s, e in ledger.in_flight("B1").items() if owned_by(e, victim)}
    deadline = {s: ledger.r.zscore(ledger.k("B1", keys.LEASES), s) for s in lost}
    assert lost and all(d is not None for d in deadline.values())
    follow(ledger, 0.3, app=stack.app(), timeout_s=240)

    # Then: every one of them started again (its first request after the kill) within a
    # lease and 2 s of the kill, and within 2 s of its lease's end, with the backlog
    # still queued behind it
    assert_exact_accounting(stack, settings, "B1", 400)
    starts = [e for e in stack.sim_log() if e["event"] == "start"]
    counted = {sid: v.split(" ")[0] for sid, v in ledger.committed("B1").items()}
    again = {sid: min(e["time"] for e in starts if e["rid"] == counted[sid]) for sid in lost}
    late = {sid: (round(t - killed_at, 2), round(t - deadline[sid], 2))
            for sid, t in again.items()
            if t - killed_at > settings.lease_s + 2 or t - deadline[sid] > 2}
    assert all(t > killed_at for t in again.values())
    assert not late, late
    fresh_after = sum(e["time"] > max(again.values()) for e in starts)
    assert fresh_after > 0
    print(f"FIGURE kill-rerun: {len(lost)} lost samples started again "
          f"{min(again.values()) - killed_at:.1f}-{max(again.values()) - killed_at:.1f}s "
          f"after the kill, {max(t - deadline[s] for s, t in again.items()):.2f}s at most "
          f"after their lease's end (lease_s={settings.lease_s}), {fresh_after} fresh "
          "requests started after the last of them")


def test_killed_workers_requests_start_again_in_time_when_the_only_reaper_started_after(
        stack: Stack) -> None:
    # Given: two workers of 4 threads, a 6 s lease, a backlog far longer than the lease
    stack.start_simulator("--lengths", "uniform:20:40", "--decode-step-s", "0.01")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 400)), short_concurrency=4,
                               short_max_tokens=100, lease_s=6.0)
    first = stack.worker("short", name="first@%h")
    second = stack.worker("short", name="second@%h")
    stack.wait_workers(2)
    ledger = start(stack, settings)
    wait_until(lambda: sum(owned_by(e, first) for e in ledger.in_flight("B1").values()) >= 2,
               30, what="the first worker to have requests in flight")

    # When: the first is killed and a fresh worker started; once the fresh one is up the
    # second is killed too, so the only reaper left is one started after both kills' work
    lost, killed_at = _kill(ledger, first)
    fresh = stack.worker("short", name="fresh@%h")
    wait_until(lambda: " ready." in fresh.log_text(), 600, what="the fresh worker up")
    wait_until(lambda: any(owned_by(e, second) for e in ledger.in_flight("B1").values()),
               60, what="the second worker to have a request in flight")
    lost2, killed2_at = _kill(ledger, second)
    follow(ledger, 0.3, app=stack.app(), timeout_s=240)

    # Then: the requests of both started again within a lease and 2 s of their kill. A
    # sample of the first kill may have started again on the second worker and been lost
    # with it (re-runs go ahead of the backlog, and the second dies about a lease after the
    # first): that request, seen in flight at the second kill, is its start again
    assert_exact_accounting(stack, settings, "B1", 400)
    started = {e["rid"]: e["time"] for e in stack.sim_log() if e["event"] == "start"}
    rids = {sid: {v.split(" ")[0]} for sid, v in ledger.committed("B1").items()}
    for sid, rid in lost2.items():
        rids[sid].add(rid)
    for samples, at in ((lost, killed_at), (lost2, killed2_at)):
        again = {sid: min(started[r] for r in rids[sid] if started.get(r, 0) > at) - at
                 for sid in samples}
        beats = [line for w in (first, second, fresh) for line in w.log_text().splitlines()
                 if "heartbeat:" in line]
        assert all(0 < t <= settings.lease_s + 2 for t in again.values()), (again, beats)
        print(f"FIGURE fresh-reaper: {len(samples)} lost requests started again "
              f"{min(again.values()):.1f}-{max(again.values()):.1f}s after their kill")


def _kill(ledger: Any, proc: Process) -> tuple[dict[str, str], float]:
    """SIGKILL a worker; the samples it had in flight (with their rids) and when it died."""
    proc.kill()
    at = time.time()
    lost = {s: e["rid"] for s, e in ledger.in_flight("B1").items() if owned_by(e, proc)}
    assert lost
    return lost, at


def test_reclaiming_goes_by_lease_even_when_a_process_with_the_same_host_and_pid_is_up(
        stack: Stack) -> None:
    # Given: a worker with requests in flight
    stack.start_simulator("--lengths", "fixed:150", "--decode-step-s", "0.02")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 8)), short_concurrency=2,
                               short_max_tokens=200)
    first = stack.worker("short", name="first@%h")
    stack.wait_workers(1)
    ledger = start(stack, settings)
    wait_until(lambda: len(ledger.in_flight("B1")) == 2, 120, what="2 requests in flight")
    old_owner = next(iter(ledger.in_flight("B1").values()))["worker"]

    # When: it dies, and its container comes back with the same host name and pid: the old
    # process's presence looks alive again, for ever
    first.kill()
    r = ledger.r
    for name in (f"{socket.gethostname()}-{first.proc.pid}", old_owner):
        r.set(keys.worker_alive(name), "1")
    second = stack.worker("short", name="second@%h")
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)

    # Then: the old entries were reclaimed by lease, the run finished exactly, and the new
    # process wrote a record file of its own
    assert ledger.snapshot("B1")["stats"]["reaped"] == 2
    assert_exact_accounting(stack, settings, "B1", 8)
    files = sorted(p.name for p in (Path(settings.output_dir) / "records" / "B1").iterdir())
    assert f"{old_owner}.jsonl" not in files and len(files) >= 1
    assert all(f.startswith(f"{socket.gethostname()}-{second.proc.pid}-") for f in files)


def test_a_release_lost_in_a_redis_blip_does_not_hold_a_slot(
        durable_stack: Stack, durable_redis: Any) -> None:
    stack, redis_server = durable_stack, durable_redis
    # Given: a worker with requests in flight, and only one retry allowed per sample
    port = free_port()
    args = ("--port", str(port), "--lengths", "fixed:200", "--decode-step-s", "0.01")
    stack.start_simulator(*args)
    settings = stack.configure(data_dir=str(partition(stack.tmp, 6)), short_concurrency=2,
                               short_max_tokens=300, max_retries=1, budgets={"B1": 10**6})
    worker = stack.worker("short")
    stack.wait_workers(1)
    ledger = start(stack, settings)
    wait_until(lambda: len(ledger.in_flight("B1")) == 2, 120, what="2 requests in flight")

    # When: Redis goes away, then the server dies under those requests: their releases
    # cannot reach Redis
    redis_server.stop()
    stack.sim.kill()
    wait_until(lambda: worker.log_text().count("deferred") >= 2, 180,
               what="both releases to be deferred")
    redis_server.start()
    stack.sim = None
    stack.start_simulator(*args, name="simulator-again")
    follow(stack.ledger(), 0.3, app=stack.app(), timeout_s=120)

    # Then: nothing was left holding a slot, and every sample is stored once
    ledger = stack.ledger()
    assert ledger.in_flight("B1") == {} and ledger.dead("B1") == {}
    assert_exact_accounting(stack, settings, "B1", 6)


def test_a_redis_outage_of_two_leases_does_not_take_live_requests_for_dead(
        durable_stack: Stack, durable_redis: Any) -> None:
    stack, redis_server = durable_stack, durable_redis
    # Given: two workers with long requests in flight, and a 2 s lease
    stack.start_simulator("--lengths", "fixed:400", "--decode-step-s", "0.02")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 8)), short_concurrency=2,
                               short_max_tokens=500, lease_s=2.0)
    stack.worker("short")
    stack.worker("short")
    stack.wait_workers(2)
    ledger = start(stack, settings)
    wait_until(lambda: len(ledger.in_flight("B1")) == 4, 120, what="4 requests in flight")

    # When: Redis is away for two leases while they run, and the follower is following
    followed: dict[str, Any] = {}
    follower = threading.Thread(target=_follow_into, args=(followed, stack.ledger(),
                                                           stack.app()), daemon=True)
    follower.start()
    redis_server.stop()
    time.sleep(2 * settings.lease_s)
    redis_server.start()
    follower.join(timeout=200)

    # Then: the follower waited the outage out and saw the run finish; no live request was
    # reclaimed or run twice, and the run finished exactly
    assert "error" not in followed and followed.get("finished"), followed
    ledger = stack.ledger()
    assert ledger.snapshot("B1")["stats"].get("reaped", 0) == 0
    starts = [e for e in stack.sim_log() if e["event"] == "start"]
    assert len(starts) == 8
    assert_exact_accounting(stack, settings, "B1", 8)


def _follow_into(out: dict[str, Any], ledger: Any, app: Any) -> None:
    try:
        out["finished"] = bool(follow(ledger, 0.3, app=app, timeout_s=180))
    except Exception as exc:  # reported by the test's assertion
        out["error"] = repr(exc)


def test_a_torn_record_file_is_ended_before_the_next_record(tmp_path: Path) -> None:
    # Given: a record file whose writer was killed mid-line
    folder = tmp_path / "records" / "B1"
    folder.mkdir(parents=True)
    (folder / "w.jsonl").write_bytes(b'{"id": "a", "dataset": "B1"}\n{"id": "b", "data')
    # When: a writer opens that file again and appends a record
    writer = RecordWriter(tmp_path, "w")
    writer.append({"id": "c", "dataset": "B1"})
    writer.close()
    # Then: the torn line is reported, and the new record reads back whole
    items = list(iter_records(folder))
    assert [i["id"] for i in items if isinstance(i, dict)] == ["a", "c"]
    assert [i.line for i in items if isinstance(i, Problem)] == [2]
    # ... and each process start gets a file of its own in the first place
    assert RecordWriter(tmp_path).writer_id != RecordWriter(tmp_path).writer_id


def test_short_visibility_timeout_does_not_run_any_sample_twice(stack: Stack) -> None:
    # Given: a visibility timeout far shorter than each request (DESIGN.md, facts)
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


def test_server_errors_are_retried_and_bad_requests_dead_lettered(stack: Stack) -> None:
    # Given: a server whose context is smaller than the producer believes
    url = stack.start_simulator("--lengths", "fixed:30", "--decode-step-s", "0.002",
                                "--context-length", "400")
    part = partition(stack.tmp, 10)
    with open(part / "B1.jsonl", "a") as fh:
        fh.write(json.dumps({"id": "B1-huge", "prompt": " ".join(["word"] * 500)}) + "\n")
    # (the producer reads the limits of a larger server: the workers' was launched smaller)
    sized_for = stack.start_simulator(name="sim-producer")
    settings = stack.configure(data_dir=str(part), short_concurrency=2, max_retries=3,
                               server_url=sized_for, long_threshold_tokens=100_000,
                               short_max_tokens=50)
    # ... and that fails the next requests with 500s and connection resets
    stack.set_fault(url, mode="error500", count=3)
    stack.worker("short", server_url=url)
    stack.wait_workers(1)
    ledger = start(stack, settings)
    wait_until(lambda: requests.get(f"{url}/_sim/fault", timeout=5).json()["mode"] == "none",
               30, what="the 500s to be used up")
    stack.set_fault(url, mode="reset", count=2)
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)

    # Then: the 400 is dead-lettered with the server's message; all others are done
    dead = ledger.dead("B1")
    assert list(dead) == ["B1-huge"]
    assert "longer than the model's context length" in dead["B1-huge"]
    rejects = [e for e in stack.sim_log() if e["event"] == "reject" and e["status"] == 400]
    assert len(rejects) == 1  # a permanent error is not retried
    assert_exact_accounting(stack, settings, "B1", 10)


def test_a_read_timeout_aborts_the_request_on_the_server(stack: Stack) -> None:
    # Given: a server slower than the read timeout (8 s per request against 1.5 s) from
    # when the worker is ready until the test says otherwise
    url = stack.start_simulator("--lengths", "fixed:40", "--decode-step-s", "0.01")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 4)), short_concurrency=4,
                               read_timeout_s=1.5, short_max_tokens=100)
    stack.worker("short")
    stack.wait_workers(1)
    stack.set_fault(url, mode="slow", factor=20)

    def aborted() -> set[str]:
        return {e["rid"] for e in stack.sim_log() if e["event"] == "abort"}
    # When: the first tries time out, each one's request is aborted on the server (no
    # zombie decoding), and then the server is fast again
    ledger = start(stack, settings)
    wait_until(lambda: len(aborted()) >= 4, 180, what="4 timed-out requests aborted")
    stack.set_fault(url, mode="none")
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)
    # Then: the retries completed every sample, each stored and counted once
    starts = {e["rid"] for e in stack.sim_log() if e["event"] == "start"}
    assert aborted() <= starts
    assert_exact_accounting(stack, settings, "B1", 4)


def test_a_server_down_for_a_while_does_not_burn_retries(stack: Stack) -> None:
    # Given: a running worker, only one retry allowed per sample, and a server that
    # answers 503 until the test says otherwise
    url = stack.start_simulator("--lengths", "fixed:20", "--decode-step-s", "0.002")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 6)), short_concurrency=3,
                               max_retries=1, short_max_tokens=50)
    worker = stack.worker("short")
    stack.wait_workers(1)
    stack.set_fault(url, mode="down")
    # When: the run starts while it is down, and every slot has met the outage
    ledger = start(stack, settings)
    wait_until(lambda: len(_down_rejects(stack)) >= 3, 180, what="3 requests refused with 503")
    wait_until(lambda: worker.log_text().count("unhealthy: waiting for it") >= 3, 180,
               what="the worker to wait for the server")
    # ... and it stays down for many retry backoffs (0.2 s each) after that
    time.sleep(2.0)
    stack.set_fault(url, mode="none")
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
    wait_until(lambda: ledger.snapshot("B1")["stats"].get("samples", 0) >= 8, 180,
               what="some samples stored")

    # When: Redis restarts with nothing in it, then the operator runs `datagen recover`
    redis_server.restart(empty=True)
    env = dict(os.environ, **stack.env)
    result = subprocess.run([sys.executable, "-m", "cli.main", "recover"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=CLI_HANG_S)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "B1:" in result.stdout and "records" in result.stdout
    stack.wait_workers(1)
    follow(stack.ledger(), 0.3, app=stack.app(), timeout_s=120)

    # Then: counters, done-set and queue were rebuilt; every sample is there exactly once
    assert_exact_accounting(stack, settings, "B1", 30)


def test_datagen_run_rebuilds_a_ledger_emptied_mid_run_and_finishes_it(stack: Stack) -> None:
    # Given: `datagen run` following a run that has stored some samples
    stack.start_simulator("--lengths", "uniform:40:80", "--decode-step-s", "0.01")
    stack.configure(data_dir=str(partition(stack.tmp, 30)), short_concurrency=3,
                    short_max_tokens=100)
    stack.worker("short")
    stack.wait_workers(1)
    run = Process("run", [sys.executable, "-m", "cli.main", "run", "--interval", "0.3"],
                  stack.tmp / "logs" / "run.log", child_env(stack.env))
    stack.procs.append(run)
    ledger = stack.ledger()
    wait_until(lambda: ledger.run_marker() is not None
               and ledger.snapshot("B1")["stats"].get("samples", 0) >= 8, 60,
               what="some samples stored")

    # When: Redis loses everything it held (queues, ledger, run marker)
    ledger.r.flushall()
    code = run.proc.wait(timeout=180)

    # Then: the follower noticed, rebuilt the ledger from the records, re-enqueued what
    # was missing, and reported done only once every sample was there, each counted once
    assert code == 0, run.log_text()[-3000:]
    assert "lost its state" in run.log_text()
    assert_exact_accounting(stack, stack.settings(), "B1", 30)
    starts = [e for e in stack.sim_log() if e["event"] == "start"]
    assert len(starts) <= 30 + 3  # at most the requests in flight at the loss ran twice


def test_recover_while_workers_run_keeps_their_commits_and_every_close_reason(
        stack: Stack) -> None:
    # Given: a running dataset, and one closed by hand
    stack.start_simulator("--lengths", "uniform:40:80", "--decode-step-s", "0.01")
    part = partition(stack.tmp, 30)
    partition(stack.tmp, 4, name="B2")
    settings = stack.configure(data_dir=str(part), short_concurrency=3, short_max_tokens=100)
    stack.worker("short")
    stack.wait_workers(1)
    ledger = start(stack, settings)
    ledger.close("B2", "operator")
    wait_until(lambda: ledger.snapshot("B1")["stats"].get("samples", 0) >= 5, 180,
               what="some samples stored")

    # When: the operator runs `datagen recover` while the worker goes on committing
    result = subprocess.run([sys.executable, "-m", "cli.main", "recover"], cwd=REPO,
                            env=child_env(stack.env), capture_output=True, text=True,
                            timeout=CLI_HANG_S)
    assert result.returncode == 0, result.stderr[-2000:]
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)

    # Then: no commit was lost or counted twice, and B2 is still closed by hand
    assert_exact_accounting(stack, settings, "B1", 30)
    assert ledger.closed("B2") == "operator"


def test_sigterm_hands_in_flight_work_back(stack: Stack) -> None:
    # Given: a worker with long requests in flight and a 1 s shutdown grace
    stack.start_simulator("--lengths", "fixed:400", "--decode-step-s", "0.02")
    settings = stack.configure(data_dir=str(partition(stack.tmp, 6)), short_concurrency=3,
                               short_max_tokens=500, shutdown_grace_s=1.0)
    first = stack.worker("short", name="first@%h")
    stack.wait_workers(1)
    ledger = start(stack, settings)
    wait_until(lambda: len(ledger.in_flight("B1")) == 3, 120, what="3 requests in flight")

    # When: it gets SIGTERM
    first.signal(signal.SIGTERM)
    first.proc.wait(timeout=CLI_HANG_S)

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
    wait_until(lambda: "cannot write record" in proc.log_text(), 120, what="a loud error")
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
                            timeout=CLI_HANG_S)
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
    wait_until(lambda: ledger.snapshot("B1")["stats"].get("samples", 0) >= 1, 120,
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
        # (50 generated each; the row's last position trains nothing: SpecForge zeroes it)
        assert snap["stats"]["truncated"] == 4 and snap["tokens"] == 4 * 49
        assert_exact_accounting(stack, settings, "B1", 4)
    else:
        # Then: dead-lettered with the reason, not counted
        assert snap["tokens"] == 0 and len(ledger.dead("B1")) == 4
        assert all("truncated" in r for r in ledger.dead("B1").values())
