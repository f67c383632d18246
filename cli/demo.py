"""`make demo`: the whole generation phase on the bundled partition, on this machine.

Starts a throwaway Redis, the SGLang simulator, a short and a long worker (the
same `datagen worker` commands an operator runs), produces, follows progress,
prints the per-dataset summary, merges, and shuts everything down.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from cli.commands import _merge_all, follow, render_produce
from cli.stack import REPO, Process, child_env, start_simulator, start_worker, wait_for_workers
from config.settings import load_settings
from datagen import status as status_mod
from datagen.celery_app import make_app
from datagen.ledger import Ledger
from datagen.redis_server import RedisServer
from datagen.tokenizer import ChatEncoder, build_tiny_tokenizer

DEMO_CONFIG = REPO / "config" / "demo.toml"
SIMULATOR_ARGS = ["--max-running-requests", "48", "--mean-output-tokens", "300",
                  "--sigma", "0.8", "--decode-step-s", "0.004", "--prefill-tokens-per-s",
                  "200000", "--context-length", "8192", "--seed", "7"]


def run_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    workdir = Path(args.workdir).resolve()
    shutil.rmtree(workdir, ignore_errors=True)
    logs = workdir / "logs"
    logs.mkdir(parents=True)
    print(f"demo: working in {workdir} (logs in {logs})", flush=True)
    tokenizer = build_tiny_tokenizer(workdir / "tokenizer")
    encoder = ChatEncoder(tokenizer)
    procs: list[Process] = []
    with RedisServer(workdir=workdir / "redis") as redis_server:
        try:
            sim, url = start_simulator(logs, SIMULATOR_ARGS + [
                "--vocab-size", str(encoder.vocab_size), "--eos-token-id",
                str(encoder.eos_token_id), "--request-log", str(workdir / "requests.jsonl")])
            procs.append(sim)
            env = {"DATAGEN_CONFIG": str(DEMO_CONFIG), "DATAGEN_REDIS_URL": redis_server.url,
                   "DATAGEN_SERVER_URL": url, "DATAGEN_OUTPUT_DIR": str(workdir / "output"),
                   "DATAGEN_TOKENIZER_PATH": str(tokenizer)}
            os.environ.update(env)
            print(f"demo: redis {redis_server.url}, simulator {url}", flush=True)
            workers = [start_worker(q, child_env(env), logs) for q in ("short", "long")]
            procs += workers
            wait_for_workers(redis_server.url, 2, procs=workers)
            print("demo: short and long workers are up", flush=True)
            return _produce_and_follow(started)
        finally:
            if not args.keep:
                for proc in reversed(procs):
                    proc.stop()


def _produce_and_follow(started: float) -> int:
    from producers.producer import Producer  # noqa: PLC0415

    settings = load_settings(DEMO_CONFIG)
    app = make_app(settings)
    ledger = Ledger.from_settings(settings)
    reports = Producer(settings, app, ledger).run()
    print(render_produce(reports), flush=True)
    table = follow(ledger, 1.0, app=app, timeout_s=240)
    print("\nsummary")
    print(status_mod.render(table))
    _merge_all(settings, ledger)
    closed = [r.dataset for r in table if r.state.startswith("closed")]
    print(f"\ndemo finished in {time.monotonic() - started:.0f}s; closed by budget: "
          f"{', '.join(closed) or 'none'}; records under {settings.output_dir}")
    return 0
