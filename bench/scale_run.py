"""The run phase of bench/bench_scale.py, and Flower as `datagen flower` starts it.

A slice of the backlog runs through several worker processes against several simulators:
per simulator one `datagen worker short` and one `datagen worker long`, their server_url
in their environment (as an operator points each pair of workers at its own server). The
slice is measured from the moment every worker beats its heartbeat to the moment the
ledger counts --run-samples more samples done, on Redis's own counters.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from bench import scale_parts as parts
from cli.stack import REPO, Process, start_simulator, start_worker, wait_for_workers
from datagen.redis_server import free_port

FLOWER_PATHS = ["/api/workers", "/api/workers?refresh=1", "/api/queues/length",
                "/api/tasks?limit=100"]
FLOWER_REPEAT = 5
SLICE_TIMEOUT_S = 1800.0

# `datagen status` less its start-up: the ledger reads and the table, timed in the process.
STATUS_CHILD = """
import json, time
t0 = time.monotonic()
from config.settings import load_settings
from datagen.generation.ledger import Ledger
from datagen.operations import status
ledger = Ledger.from_settings(load_settings())
t1 = time.monotonic()
table = status.render(status.rows(ledger))
print(json.dumps({"import_s": round(t1 - t0, 3),
                  "rows_and_render_s": round(time.monotonic() - t1, 4)}))
"""


def status_in_process(env: dict[str, str]) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", STATUS_CHILD], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_flower(env: dict[str, str], log_dir: Path, timeout_s: float = 120.0
                 ) -> tuple[Process, str, tuple[str, str]]:
    """``datagen flower`` on a free port with a login of its own (tests/test_operations.py)."""
    auth = ("bench", secrets.token_urlsafe(8))
    port = free_port()
    proc = Process("flower", [sys.executable, "-m", "cli.main", "flower", "--port", str(port)],
                   log_dir / "flower.log", dict(env, DATAGEN_FLOWER_BASIC_AUTH=":".join(auth)))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/healthcheck", timeout=2).status_code == 200:
                return proc, url, auth
        except requests.RequestException:
            pass
        if not proc.alive():
            break
        time.sleep(0.2)
    proc.stop()
    raise SystemExit(f"Flower did not answer within {timeout_s}s:\n{proc.log_text()[-3000:]}")


def flower_api(url: str, auth: tuple[str, str]) -> dict[str, Any]:
    return parts.timed_gets(url, FLOWER_PATHS, auth, FLOWER_REPEAT)


def run_slice(args: argparse.Namespace, env: dict[str, str], redis_url: str,
              ledger: parts.Ledger, log_dir: Path, watched: dict[str, list[int]],
              after: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The slice's figures, and what ``after`` measures while the workers are still up."""
    procs: list[Process] = []
    try:
        sims = [start_simulator(log_dir, [
            "--max-running-requests", str(args.short_concurrency + args.long_concurrency),
            "--decode-step-s", str(args.decode_step_s),
            "--mean-output-tokens", str(args.mean_output_tokens), "--sigma", "0.5",
            "--context-length", str(parts.CONTEXT_LENGTH), "--vocab-size", "4096",
            "--eos-token-id", "2", "--seed", str(i), "--log-level", "WARNING"],
            name=f"sim{i}") for i in range(args.simulators)]
        procs += [proc for proc, _ in sims]
        workers = []
        for i, (_, sim_url) in enumerate(sims):
            for queue, threads in (("short", args.short_concurrency),
                                   ("long", args.long_concurrency)):
                workers.append(start_worker(queue, dict(
                    env, DATAGEN_SERVER_URL=sim_url,
                    **{f"DATAGEN_{queue.upper()}_CONCURRENCY": str(threads)}),
                    log_dir, name=f"{queue}{i}@bench"))
        procs += workers
        wait_for_workers(redis_url, len(workers), timeout_s=300, procs=workers)
        pids = {"workers": [w.pid for w in workers], "simulators": [p.pid for p, _ in sims],
                **watched}
        figures = measure(args.run_samples, ledger, pids, workers)
        figures["with_workers"] = after()
        return figures
    finally:
        for proc in reversed(procs):
            proc.stop(timeout_s=20)


def measure(samples: int, ledger: parts.Ledger, pids: dict[str, list[int]],
            workers: list[Process]) -> dict[str, Any]:
    """Redis's counters, the ledger's counts and the processes' CPU at the start and at the
    end of the slice: every worker up, then until ``samples`` more are done."""
    start = snapshot(ledger, pids)
    deadline = time.monotonic() + SLICE_TIMEOUT_S
    while ledger.done() - start["done"] < samples:
        if time.monotonic() > deadline:
            raise SystemExit(f"{samples} samples not done in {SLICE_TIMEOUT_S}s")
        for proc in workers:
            if not proc.alive():
                raise SystemExit(f"worker {proc.name} exited:\n{proc.log_text()[-3000:]}")
        time.sleep(0.1)
    end = snapshot(ledger, pids)
    seconds = end["time"] - start["time"]
    done = end["done"] - start["done"]
    consumed = {q: start["queued"][q] - end["queued"][q] for q in start["queued"]}
    redis = parts.rates(start["redis"], end["redis"], seconds)
    return {"seconds": round(seconds, 2), "samples": done,
            "samples_per_s": round(done / seconds, 1),
            "tasks_taken": consumed,  # from the queues over the slice
            "redis": redis, "redis_commands_per_sample": round(redis["commands"] / done, 1),
            "cores": {g: round((end["cpu"][g] - start["cpu"][g]) / seconds, 3)
                      for g in start["cpu"]},
            "pending_after": ledger.count("pending")}


def snapshot(ledger: parts.Ledger, pids: dict[str, list[int]]) -> dict[str, Any]:
    return {"time": time.monotonic(), "done": ledger.done(), "redis": ledger.counters(),
            "queued": {q: ledger.queued(q) for q in ("short", "long")},
            "cpu": parts.cpu_seconds(pids)}
