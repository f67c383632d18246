"""How precisely the budget guard stops a dataset: precise admission vs the naive stop.

Runs one dataset through a real short worker (150 threads) against the SGLang
simulator (mean ~3.7K tokens, lognormal tail), with both admission rules side
by side in one run, and reports overshoot, discarded tokens, requests started
after the close, and the time between 95% of the budget and the close.

    .venv/bin/python bench/bench_budget.py            # budget 2M, 150 workers, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cli.stack import child_env, start_simulator, start_worker, wait_for_workers  # noqa: E402
from config.settings import load_settings  # noqa: E402
from datagen.celery_app import make_app  # noqa: E402
from datagen.generation.ledger import Ledger  # noqa: E402
from datagen.redis_server import RedisServer  # noqa: E402
from datagen.tokenizer import ChatEncoder, build_tiny_tokenizer  # noqa: E402
from producers.producer import Producer  # noqa: E402

DATASET = "B1_bench"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=int, default=2_000_000)
    p.add_argument("--workers", type=int, default=150, help="short-queue concurrency")
    p.add_argument("--prompts", type=int, default=1500)
    p.add_argument("--mean", type=float, default=3700)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=10240)
    p.add_argument("--decode-step-s", type=float, default=0.0006)
    p.add_argument("--rounds", type=int, default=3, help="rounds of (precise, naive)")
    p.add_argument("--margin-sd", type=float, default=None,
                   help="admission_margin_sd for the precise rule (default: the setting's)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "budget.json"))
    return p.parse_args()


class Timeline(threading.Thread):
    """Samples the committed tokens every 50 ms: when did the count pass 95%?"""

    def __init__(self, ledger: Ledger):
        super().__init__(daemon=True)
        self.ledger = ledger
        self.points: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.points.append((time.time(), self.ledger.snapshot(DATASET)["tokens"]))


def make_partition(root: Path, n: int) -> Path:
    folder = root / "partition" / DATASET
    folder.mkdir(parents=True)
    with open(folder / "p.jsonl", "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"q{i:06d}", "prompt": f"Explain topic {i} in depth."})
                     + "\n")
    return root / "partition"


def one_round(args: argparse.Namespace, precise: bool, tmp: Path, tokenizer: Path,
              encoder: ChatEncoder) -> dict[str, Any]:
    logs = tmp / "logs"
    with RedisServer(workdir=tmp / "redis") as srv:
        sim, url = start_simulator(logs, [
            "--max-running-requests", str(args.workers + 50), "--mean-output-tokens",
            str(args.mean), "--sigma", str(args.sigma), "--decode-step-s",
            str(args.decode_step_s), "--prefill-tokens-per-s", "1000000", "--seed", "11",
            "--vocab-size", str(encoder.vocab_size), "--eos-token-id",
            str(encoder.eos_token_id)], name=f"sim-{int(precise)}")
        env = {"DATAGEN_REDIS_URL": srv.url, "DATAGEN_SERVER_URL": url,
               "DATAGEN_OUTPUT_DIR": str(tmp / "out"), "DATAGEN_TOKENIZER_PATH": str(tokenizer),
               "DATAGEN_DATA_DIR": str(make_partition(tmp, args.prompts)),
               "DATAGEN_TOKEN_BUDGET": str(args.budget),
               "DATAGEN_SHORT_CONCURRENCY": str(args.workers),
               "DATAGEN_SHORT_MAX_TOKENS": str(args.max_new_tokens),
               "DATAGEN_PRECISE_ADMISSION": str(precise), "DATAGEN_LEASE_S": "10"}
        if args.margin_sd is not None:
            env["DATAGEN_ADMISSION_MARGIN_SD"] = str(args.margin_sd)
        worker = start_worker("short", child_env(env), logs, name=f"bench{int(precise)}@%h")
        try:
            wait_for_workers(srv.url, 1, procs=[worker])
            settings = load_settings(None, env=env)
            ledger = Ledger.from_settings(settings)
            timeline = Timeline(ledger)
            timeline.start()
            started = time.time()
            Producer(settings, make_app(settings), ledger).run()
            _wait_closed_and_drained(ledger)
            timeline.stop.set()
            sim_log = requests.get(f"{url}/_sim/log", timeout=30).json()
            return _measure(args, ledger, timeline.points, sim_log, started, precise)
        finally:
            worker.stop()
            sim.stop()


def _wait_closed_and_drained(ledger: Ledger, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = ledger.snapshot(DATASET)
        if snap["closed"] and snap["in_flight"] == 0:
            time.sleep(1.0)  # let stragglers that slipped past land in the log
            return
        time.sleep(0.1)
    raise TimeoutError("dataset did not close")


def _measure(args: argparse.Namespace, ledger: Ledger, points: list[tuple[float, int]],
             sim_log: list[dict[str, Any]], started: float, precise: bool) -> dict[str, Any]:
    snap = ledger.snapshot(DATASET)
    close_t = next(e["t"] for e in ledger.events(DATASET) if e["e"].startswith("closed"))
    starts = [e for e in sim_log if e["event"] == "start" and e.get("dataset") == DATASET]
    finished = [e for e in sim_log if e["event"] in ("finish", "abort")
                and e.get("dataset") == DATASET]
    generated = sum(int(e.get("completion_tokens") or 0) for e in finished)
    committed = snap["tokens"]
    t95 = next((t for t, tok in points if tok >= 0.95 * args.budget), close_t)
    after = [e for e in starts if e["time"] > close_t]
    return {
        "rule": "precise" if precise else "naive",
        "budget": args.budget, "committed": committed,
        "overshoot_pct": 100.0 * (committed - args.budget) / args.budget,
        "discarded_pct": 100.0 * max(0, generated - committed) / args.budget,
        "samples": snap["stats"].get("samples", 0),
        "requests_after_close": len(after),
        "last_start_after_close_s": max((e["time"] for e in starts), default=close_t) - close_t,
        "from_95pct_to_close_s": close_t - t95,
        "run_s": close_t - started,
    }


def main() -> int:
    args = parse_args()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-budget-") as tmp_name:
        tmp = Path(tmp_name)
        tokenizer = build_tiny_tokenizer(tmp / "tok")
        encoder = ChatEncoder(tokenizer)
        for rnd in range(args.rounds):
            for precise in (True, False):
                sub = tmp / f"r{rnd}-{int(precise)}"
                sub.mkdir()
                results.append(one_round(args, precise, sub, tokenizer, encoder))
                print(_row(results[-1]), flush=True)
    print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cores": _cores(), "python": platform.python_version()},
        "args": vars(args), "rounds": results}, indent=2))
    return 0


COLUMNS = ("rule", "committed", "overshoot_pct", "discarded_pct", "requests_after_close",
           "last_start_after_close_s", "from_95pct_to_close_s", "run_s")


def _row(r: dict[str, Any]) -> str:
    return " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS)


def print_table(results: list[dict[str, Any]]) -> None:
    print("\n| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for r in results:
        print(f"| {_row(r)} |")
    for rule in ("precise", "naive"):
        over = [r["overshoot_pct"] for r in results if r["rule"] == rule]
        print(f"{rule}: median overshoot {statistics.median(over):.3f}%")


def _cores() -> int:
    import os

    return os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
