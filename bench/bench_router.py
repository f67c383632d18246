"""How the SGLang router shares the workers' concurrency between its servers, per policy.

One short worker at the sum of two simulators' limits runs one dataset to its budget
through `sglang-router`; the simulators report the most requests they had open at once
(`peak_in_flight`). The policy keeps each server's limit only if no peak passes it.

    .venv/bin/python bench/bench_router.py     # 2 servers x limit 4, ~25 s a policy
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cli.stack import (  # noqa: E402
    Process,
    child_env,
    start_simulator,
    start_worker,
    wait_for_workers,
)
from config.settings import load_settings  # noqa: E402
from datagen.celery_app import make_app  # noqa: E402
from datagen.generation.follower import follow  # noqa: E402
from datagen.generation.ledger import Ledger  # noqa: E402
from datagen.redis_server import RedisServer, free_port  # noqa: E402
from datagen.tokenization.chat import ChatEncoder  # noqa: E402
from datagen.tokenization.tokenizer import build_tiny_tokenizer  # noqa: E402
from producers.producer import Producer  # noqa: E402

POLICIES = {
    "round_robin": ["--policy", "round_robin"],
    "power_of_two": ["--policy", "power_of_two"],
    "cache_aware (defaults)": ["--policy", "cache_aware"],
    "cache_aware 0 / 1.0": ["--policy", "cache_aware", "--balance-abs-threshold", "0",
                            "--balance-rel-threshold", "1.0"],
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=4, help="each simulator's batch")
    p.add_argument("--budget", type=int, default=15_000)
    p.add_argument("--prompts", type=int, default=150)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "router.json"))
    return p.parse_args()


def wait_listed(url: str, servers: list[str], router: Process) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not router.alive():
            raise RuntimeError(f"router exited:\n{router.log_text()[-3000:]}")
        try:
            listed = requests.get(f"{url}/workers", timeout=2).json()["workers"]
            if sorted(w["url"] for w in listed if w["is_healthy"]) == sorted(servers):
                return
        except (requests.RequestException, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise RuntimeError("the router did not list both servers")


def one_policy(tmp: Path, flags: list[str], args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = build_tiny_tokenizer(tmp / "tokenizer")
    encoder = ChatEncoder(tokenizer)
    logs = tmp / "logs"
    procs: list[Process] = []
    with RedisServer(workdir=tmp / "redis") as redis_server:
        try:
            servers = []
            for i in range(2):
                proc, url = start_simulator(logs, [
                    "--max-running-requests", str(args.limit), "--mean-output-tokens", "200",
                    "--sigma", "0.8", "--decode-step-s", "0.004",
                    "--vocab-size", str(encoder.vocab_size),
                    "--eos-token-id", str(encoder.eos_token_id),
                    "--model-path", str(tokenizer)], name=f"sim-{i}")
                procs.append(proc)
                servers.append(url)
            port = free_port()
            router = Process("router", [sys.executable, "-m", "sglang_router.launch_router",
                                        "--host", "127.0.0.1", "--port", str(port),
                                        "--prometheus-port", str(free_port()),
                                        "--worker-urls", *servers, "--log-level", "warn",
                                        *flags], logs / "router.log")
            procs.append(router)
            router_url = f"http://127.0.0.1:{port}"
            wait_listed(router_url, servers, router)
            partition = tmp / "partition"
            partition.mkdir()
            with open(partition / "B1.jsonl", "w", encoding="utf-8") as fh:
                for i in range(args.prompts):
                    fh.write(json.dumps({"id": f"B1-{i}", "prompt": f"Tell me about {i}"}))
                    fh.write("\n")
            env = {"DATAGEN_REDIS_URL": redis_server.url, "DATAGEN_SERVER_URL": router_url,
                   "DATAGEN_OUTPUT_DIR": str(tmp / "out"), "DATAGEN_DATA_DIR": str(partition),
                   "DATAGEN_TOKENIZER_PATH": str(tokenizer),
                   "DATAGEN_SHORT_CONCURRENCY": str(2 * args.limit),
                   "DATAGEN_SHORT_MAX_TOKENS": "1200",
                   "DATAGEN_TOKEN_BUDGET": str(args.budget)}
            procs.append(start_worker("short", child_env(env), logs))
            wait_for_workers(redis_server.url, 1, procs=procs)
            settings = load_settings(None, env=env)
            ledger, app = Ledger.from_settings(settings), make_app(settings)
            Producer(settings, app, ledger).run()
            follow(ledger, 1.0, app=app, timeout_s=300)
            peaks = [requests.get(f"{s}/_sim/stats", timeout=10).json()["peak_in_flight"]
                     for s in servers]
            return {"peak_in_flight": peaks, "limit": args.limit,
                    "tokens": ledger.snapshot("B1")["tokens"]}
        finally:
            for proc in reversed(procs):
                proc.stop()


def main() -> None:
    args = parse_args()
    results = {}
    for name, flags in POLICIES.items():
        with tempfile.TemporaryDirectory(prefix="bench-router-") as tmp:
            results[name] = {"flags": flags, **one_policy(Path(tmp), flags, args)}
    print(f"{'policy':<24} {'peak open per server':>22}   limit {args.limit}")
    for name, row in results.items():
        held = "holds" if max(row["peak_in_flight"]) <= args.limit else "passed"
        print(f"{name:<24} {str(row['peak_in_flight']):>22}   {held}")
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
