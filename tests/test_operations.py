"""Operating a run: Flower, status output, and adding machines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import requests
from conftest import CLI_HANG_S, Stack, wait_until, write_jsonl
from prometheus_client.parser import text_string_to_metric_families

from cli.stack import REPO, START_TIMEOUT_S, Process, child_env
from datagen.generation.follower import follow
from datagen.redis_server import free_port
from producers.producer import Producer


def partition(root: Path, sizes: dict[str, int]) -> Path:
    for name, n in sizes.items():
        write_jsonl(root / "partition" / f"{name}.jsonl",
                    [{"id": f"{name}-{i:03d}", "prompt": f"topic {i}"} for i in range(n)])
    return root / "partition"


def start_flower(stack: Stack, auth: str) -> str:
    port = free_port()
    env = dict(os.environ, **stack.env, DATAGEN_FLOWER_BASIC_AUTH=auth)
    proc = Process("flower", [sys.executable, "-m", "cli.main", "flower", "--port", str(port)],
                   stack.tmp / "logs" / "flower.log", env)
    stack.procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _answers(url, proc), START_TIMEOUT_S, what="Flower to answer")
    # Flower answers before its event receiver has subscribed to the broker's event channel
    # (a Redis PUBLISH, lost to a subscriber that is not there yet): a task sent before that
    # shows in Flower without its task-sent event, never to get it (a revoked task gets no
    # received event either). The workers' heartbeats are events: once Flower has counted
    # one, it hears the producer's too.
    user, _, password = auth.partition(":")
    wait_until(lambda: _heard_events(url, (user, password)), START_TIMEOUT_S,
               what="Flower's event receiver to hear a worker's heartbeat")
    return url


def _heard_events(url: str, auth: tuple[str, str]) -> bool:
    """Whether Flower's own metrics show a worker online, which only a worker-online or
    worker-heartbeat event received sets."""
    text = requests.get(f"{url}/metrics", auth=auth, timeout=10).text
    return any(sample.value == 1 for family in text_string_to_metric_families(text)
               if family.name == "flower_worker_online" for sample in family.samples)


def _answers(url: str, proc: Process) -> bool:
    """Whether Flower answers yet; raises at once if it exited instead of starting."""
    if not proc.alive():
        raise RuntimeError(f"flower exited:\n{proc.log_text()[-3000:]}")
    try:
        return requests.get(f"{url}/healthcheck", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def test_flower_shows_workers_queues_and_revoked_tasks_and_requires_login(
        stack: Stack) -> None:
    # Given: a run where one dataset closes early with tasks still queued, and one prompt
    # longer than the server's context (the producer believes in a larger one)
    stack.start_simulator("--lengths", "fixed:100", "--decode-step-s", "0.005",
                          "--context-length", "400")
    part = partition(stack.tmp, {"B1": 40, "B2": 6})
    with open(part / "B2.jsonl", "a") as fh:
        fh.write(json.dumps({"id": "B2-huge", "prompt": "word " * 500}) + "\n")
    served_by = stack.sim_url
    sized_for = stack.start_simulator(name="sim-producer")  # a larger one, read by the producer
    settings = stack.configure(data_dir=str(part), server_url=sized_for,
                               short_concurrency=2, short_max_tokens=200,
                               long_threshold_tokens=100_000,
                               budgets={"B1": 300}, token_budget=10**6)
    stack.worker("short", name="short-a@%h", server_url=served_by)
    stack.wait_workers(1)
    url = start_flower(stack, "ops:s3cret-pass")
    auth = ("ops", "s3cret-pass")
    ledger = stack.ledger()
    Producer(settings, stack.app(), ledger).run()

    # Flower sees the queue while it is long, and refuses requests without credentials
    lengths = requests.get(f"{url}/api/queues/length", auth=auth, timeout=10).json()
    # every queue of the run, not only those of the workers Flower inspected (one short one)
    assert {q["name"] for q in lengths["active_queues"]} == {"short", "long", "gpu"}
    broker = requests.get(f"{url}/broker", auth=auth, timeout=10)
    assert broker.status_code == 200
    assert all(f">{name}<" in broker.text.replace(" ", "") for name in ("short", "long", "gpu"))
    assert requests.get(f"{url}/api/workers", timeout=10).status_code == 401
    # Flower's /metrics is closed like every page; /healthcheck says only "OK"
    assert requests.get(f"{url}/metrics", timeout=10).status_code == 401
    assert requests.get(f"{url}/metrics", auth=auth, timeout=10).status_code == 200
    assert requests.get(f"{url}/healthcheck", timeout=10).text == "OK"
    assert requests.get(f"{url}/api/tasks", auth=("ops", "wrong"), timeout=10).status_code == 401

    follow(ledger, 0.3, app=stack.app(), timeout_s=120)

    # Then: the worker is listed, and the closed dataset's dropped tasks show as revoked
    def workers() -> dict[str, Any]:
        return requests.get(f"{url}/api/workers?refresh=1", auth=auth, timeout=20).json()
    wait_until(lambda: any(name.startswith("short-a@") for name in workers()), 180,
               what="Flower to list the worker")

    def revoked() -> int:
        tasks = requests.get(f"{url}/api/tasks", params={"state": "REVOKED"}, auth=auth,
                             timeout=20).json()
        return len(tasks)
    wait_until(lambda: revoked() > 0, 180, what="revoked tasks in Flower")
    # every row tells its dataset and sample apart. A row's kwargs come with the task's sent
    # or received event; Flower may list a task from a later event first (its worker's
    # revoke beside a loaded producer's batch of sent events), so wait for those events
    def listed_tasks() -> list[dict[str, Any]]:
        return list(requests.get(f"{url}/api/tasks", auth=auth, timeout=20).json().values())
    wait_until(lambda: all(t["kwargs"] for t in listed_tasks()), 180,
               what="every listed task's sent or received event in Flower")
    listed = listed_tasks()
    assert {t["kwargs"].split("/")[0] for t in listed} == {"B1", "B2"}
    assert all(t["kwargs"].count("/") == 1 for t in listed)
    assert ledger.snapshot("B1")["stats"]["revoked"] > 0

    # ... and tasks refused admission (parked until a commit woke them) show as waiting:
    # with 300 tokens of budget and a cap of 200, a second request of B1 never fits beside
    # a first one at their caps, nor once the model has seen one response of 100 (2/3 of its
    # mass is still at the cap)
    def waiting() -> int:
        tasks = requests.get(f"{url}/api/tasks", params={"state": "WAITING"}, auth=auth,
                             timeout=20).json()
        return len(tasks)
    wait_until(lambda: waiting() > 0, 120, what="waiting tasks in Flower")

    # ... and a dead-lettered sample is a failure to an operator, with its reason
    assert list(ledger.dead("B2")) == ["B2-huge"]

    def failed() -> list[dict[str, Any]]:
        return list(requests.get(f"{url}/api/tasks", params={"state": "FAILURE"}, auth=auth,
                                 timeout=20).json().values())
    wait_until(lambda: len(failed()) == 1, 120, what="the dead letter as a failure in Flower")
    assert "longer than the model's context length" in failed()[0]["exception"]


def test_status_json_equals_the_ledger(stack: Stack) -> None:
    stack.start_simulator("--lengths", "fixed:50", "--decode-step-s", "0.002")
    settings = stack.configure(data_dir=str(partition(stack.tmp, {"B1": 8, "B2": 5})),
                               short_concurrency=4, short_max_tokens=100,
                               budgets={"B2": 120}, token_budget=10**6)
    stack.worker("short")
    stack.wait_workers(1)
    ledger = stack.ledger()
    Producer(settings, stack.app(), ledger).run()
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)

    env = dict(os.environ, **stack.env)
    out = subprocess.run([sys.executable, "-m", "cli.main", "status", "--json"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=CLI_HANG_S)
    assert out.returncode == 0, out.stderr
    rows = {r["dataset"]: r for r in json.loads(out.stdout)}
    for name in ("B1", "B2"):
        snap = ledger.snapshot(name)
        assert rows[name]["tokens"] == snap["tokens"]
        assert rows[name]["budget"] == snap["budget"]
        assert rows[name]["samples"] == snap["stats"]["samples"]
        assert rows[name]["in_flight"] == snap["in_flight"] == 0
    assert rows["B1"]["state"] == "done" and rows["B1"]["samples"] == 8
    assert rows["B2"]["state"] == "closed at budget"
    # a closed dataset's dropped tasks count as revoked, not as still queued
    assert rows["B2"]["queued"] == 0 and rows["B2"]["waiting"] == 0
    table = subprocess.run([sys.executable, "-m", "cli.main", "status"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=CLI_HANG_S)
    assert "closed at budget" in table.stdout and "total" in table.stdout


def _run(stack: Stack, settings: Any) -> list[Any]:
    ledger = stack.ledger()
    reports = Producer(settings, stack.app(), ledger).run()
    follow(ledger, 0.2, app=stack.app(), timeout_s=180)
    return reports


def _serving_span(stack: Stack, urls: list[str], dataset: str) -> float:
    """From the dataset's first request in to its last answer out, in the servers' own logs.

    Producer start-up (tokenizer, Celery) and worker start-up stay outside the span, so a
    slow machine lengthens both runs' spans alike instead of the shorter one most.
    """
    events = [e for url in urls for e in stack.sim_log(url) if e["dataset"] == dataset]
    starts = [e["time"] for e in events if e["event"] == "start"]
    ends = [e["time"] for e in events if e["event"] == "finish"]
    assert len(starts) == len(ends) > 0, dataset
    return max(ends) - min(starts)


def _peak_in_flight(url: str) -> int:
    """The most requests the workers had open at this server at once, running or queued."""
    return int(requests.get(f"{url}/_sim/stats", timeout=5).json()["peak_in_flight"])


def test_a_second_machine_adds_its_own_limits_and_finishes_sooner(stack: Stack) -> None:
    # Given: one server with room for far more than the workers may send (so their limits,
    # not the server's, bound what it sees), and a worker pair with its limits
    sim_args = ("--lengths", "fixed:100", "--decode-step-s", "0.01", "--batch-slowdown", "0",
                "--max-running-requests", "16")
    first = stack.start_simulator(*sim_args, name="sim-a")
    settings = stack.configure(data_dir=str(partition(stack.tmp, {"B1": 32})),
                               short_concurrency=4, long_concurrency=1, short_max_tokens=200)
    # Each pair sends only to its own server; every prompt here is short, so the long
    # worker sends nothing and the short worker's threads are the whole limit.
    limit = settings.short_concurrency
    stack.worker("short", name="a-short@%h")
    stack.worker("long", name="a-long@%h")
    stack.wait_workers(2)
    reports = _run(stack, settings)
    assert [(r.short, r.long) for r in reports] == [(32, 0)]
    alone = _serving_span(stack, [first], "B1")
    assert _peak_in_flight(first) <= limit

    # When: a second machine joins: its own server and worker pair, same Redis and output
    second = stack.start_simulator(*sim_args, name="sim-b")
    stack.worker("short", name="b-short@%h", server_url=second)
    stack.worker("long", name="b-long@%h", server_url=second)
    stack.wait_workers(4)
    settings2 = stack.configure(data_dir=str(partition(stack.tmp / "second", {"B2": 32})),
                                short_concurrency=4, long_concurrency=1, short_max_tokens=200)
    reports = _run(stack, settings2)
    assert [(r.short, r.long) for r in reports] == [(32, 0)]
    together = _serving_span(stack, [first, second], "B2")

    # Then: each server saw at most its own pair's limit at once, both served B2, and the
    # run took much less time
    peaks = (_peak_in_flight(first), _peak_in_flight(second))
    print(f"FIGURE second machine: peaks {peaks} limit {limit} alone {alone:.1f}s "
          f"together {together:.1f}s")
    assert max(peaks) <= limit, peaks
    b2_servers = {e["rid"]: url for url in (first, second) for e in stack.sim_log(url)
                  if e["event"] == "finish" and e["dataset"] == "B2"}
    assert set(b2_servers.values()) == {first, second}
    assert together < 0.75 * alone, (alone, together)


def _datagen(stack: Stack, *argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, **stack.env)
    return subprocess.run([sys.executable, "-m", "cli.main", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=CLI_HANG_S)


def test_a_finished_run_with_skipped_lines_exits_0_and_strict_exits_3(stack: Stack) -> None:
    # Given: a dataset with one line that is not JSON
    stack.start_simulator("--lengths", "fixed:20", "--decode-step-s", "0.001")
    part = partition(stack.tmp, {"B1": 4})
    with open(part / "B1.jsonl", "a") as fh:
        fh.write("{not json\n")
    stack.configure(data_dir=str(part), short_concurrency=2, short_max_tokens=50)
    stack.worker("short")
    stack.wait_workers(1)
    # When: `datagen run` runs to its end
    first = _datagen(stack, "run", "--interval", "0.3")
    # Then: the run completed, so `make run && make prepare` goes on; the skip is loud
    assert first.returncode == 0, first.stderr[-3000:]
    assert "input lines were skipped as bad" in first.stderr
    assert stack.ledger().snapshot("B1")["stats"]["samples"] == 4
    # ... and --strict keeps the old exit status for those who want it
    strict = _datagen(stack, "run", "--interval", "0.3", "--strict")
    assert strict.returncode == 3, strict.stderr[-3000:]


def test_budget_refuses_an_unknown_dataset_and_a_negative_budget(stack: Stack) -> None:
    settings = stack.configure(data_dir=str(partition(stack.tmp, {"B1": 2})),
                               server_url="http://127.0.0.1:9")
    stack.ledger().register(["B1"])
    unknown = _datagen(stack, "budget", "B9_nope", "5000")
    assert unknown.returncode == 2
    assert "unknown dataset 'B9_nope'" in unknown.stderr and "B1" in unknown.stderr
    negative = _datagen(stack, "budget", "B1", "-5")
    assert negative.returncode == 2 and "must be >= 0" in negative.stderr
    ledger = stack.ledger()
    assert ledger.budget("B1") == settings.budget_for("B1") and not ledger.closed("B1")


def test_settings_flags_after_the_queue_name_reach_the_worker(stack: Stack) -> None:
    # Given: a settings file naming the run's Redis, and an environment that names none
    config = stack.tmp / "my-run.toml"
    config.write_text(f'redis_url = "{stack.redis_url}"\nserver_url = "http://127.0.0.1:9"\n'
                      f'short_concurrency = 3\noutput_dir = "{stack.tmp / "out"}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")}
    # When: the worker is started as `make workers CONFIG=...` starts it
    proc = Process("cfg-worker", [sys.executable, "-m", "cli.main", "worker", "short",
                                  "--config", str(config), "-n", "cfg@%h"],
                   stack.tmp / "logs" / "cfg-worker.log", child_env(env))
    stack.procs.append(proc)
    # Then: it consumes from the Redis the file names, with the file's concurrency
    stack.wait_workers(1, procs=[proc])
    assert "concurrency: 3 (thread)" in proc.log_text()


def test_make_workers_fails_when_a_worker_exits(tmp_path: Path) -> None:
    # Given: a settings file a worker refuses
    config = tmp_path / "bad.toml"
    config.write_text("short_concurrency = -1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")}
    # When: `make workers CONFIG=...` starts both workers
    result = subprocess.run(["make", "-s", "workers", f"CONFIG={config}"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=CLI_HANG_S)
    # Then: make says so, with the setting named
    assert result.returncode != 0
    assert "short_concurrency" in result.stderr
