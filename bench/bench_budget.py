"""How precisely the budget guard stops a dataset: precise admission vs the naive stop.

Runs datasets through a real short worker (150 threads) against the SGLang
simulator (mean ~3.7K tokens, lognormal tail), with both admission rules side
by side in one run, and reports per dataset: overshoot, discarded tokens,
requests started after the close, the time between 95% of the budget and the
close, Celery task runs per prompt enqueued (from the worker's log), and Redis commands
per second in the last 5% before the close against the steady state (20-80%).

    .venv/bin/python bench/bench_budget.py            # budget 2M, 150 workers, 3 rounds
    .venv/bin/python bench/bench_budget.py --datasets 4 --budget 300000   # sharing a server
    .venv/bin/python bench/bench_budget.py --budget 15000 --rules precise,min16  # small budget
    .venv/bin/python bench/bench_budget.py --rules precise --setting cap_to_window=false
        # a budget of trainable tokens (the default) while responses run past the window
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
from datagen.tokenization.chat import ChatEncoder  # noqa: E402
from datagen.tokenization.tokenizer import build_tiny_tokenizer  # noqa: E402
from producers.producer import Producer  # noqa: E402

DATASET = "B1_bench"


def names(count: int) -> list[str]:
    return [DATASET] if count == 1 else [f"B{i + 1}_bench" for i in range(count)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=int, default=2_000_000, help="per dataset")
    p.add_argument("--datasets", type=int, default=1, help="datasets sharing the server")
    p.add_argument("--workers", type=int, default=150, help="short-queue concurrency")
    p.add_argument("--prompts", type=int, default=1500)
    p.add_argument("--mean", type=float, default=3700)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=10240)
    p.add_argument("--decode-step-s", type=float, default=0.0006)
    p.add_argument("--rounds", type=int, default=3, help="rounds of (precise, naive)")
    p.add_argument("--margin-sd", type=float, default=None,
                   help="admission_margin_sd for the precise rule (default: the setting's)")
    p.add_argument("--rules", default="precise,naive",
                   help="comma list, run in this order each round: precise (the settings' "
                        "rule), min16 (precise, the length model only after 16 responses: "
                        "the rule before v3), naive")
    p.add_argument("--setting", action="append", default=[], metavar="NAME=VALUE",
                   help="another setting of every process, e.g. cap_to_window=false")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "budget.json"))
    return p.parse_args()


class Timeline(threading.Thread):
    """Samples committed tokens and Redis's command count every 50 ms."""

    def __init__(self, ledger: Ledger, datasets: list[str]):
        super().__init__(daemon=True)
        self.ledger = ledger
        self.datasets = datasets
        self.points: list[tuple[float, dict[str, int], int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            tokens = {d: self.ledger.snapshot(d)["tokens"] for d in self.datasets}
            commands = int(self.ledger.r.info("stats")["total_commands_processed"])
            self.points.append((time.time(), tokens, commands))

    def passed(self, dataset: str, level: float, default: float) -> float:
        return next((t for t, tok, _ in self.points if tok[dataset] >= level), default)

    def command_rate(self, t0: float, t1: float) -> float | None:
        inside = [(t, c) for t, _, c in self.points if t0 <= t <= t1]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def make_partition(root: Path, n: int, datasets: list[str]) -> Path:
    for dataset in datasets:
        folder = root / "partition" / dataset
        folder.mkdir(parents=True)
        with open(folder / "p.jsonl", "w") as fh:
            for i in range(n):
                fh.write(json.dumps({"id": f"q{i:06d}",
                                     "prompt": f"Explain topic {i} in depth."}) + "\n")
    return root / "partition"


RULES = {"precise": {}, "min16": {"DATAGEN_ADMISSION_MIN_RESPONSES": "16"},
         "naive": {"DATAGEN_PRECISE_ADMISSION": "False"}}


def one_round(args: argparse.Namespace, rule: str, tmp: Path, tokenizer: Path,
              encoder: ChatEncoder) -> dict[str, Any]:
    logs = tmp / "logs"
    datasets = names(args.datasets)
    with RedisServer(workdir=tmp / "redis") as srv:
        sim, url = start_simulator(logs, [
            "--max-running-requests", str(args.workers + 50), "--mean-output-tokens",
            str(args.mean), "--sigma", str(args.sigma), "--decode-step-s",
            str(args.decode_step_s), "--prefill-tokens-per-s", "1000000", "--seed", "11",
            "--vocab-size", str(encoder.vocab_size), "--eos-token-id",
            str(encoder.eos_token_id)], name=f"sim-{rule}")
        env = {"DATAGEN_REDIS_URL": srv.url, "DATAGEN_SERVER_URL": url,
               "DATAGEN_OUTPUT_DIR": str(tmp / "out"), "DATAGEN_TOKENIZER_PATH": str(tokenizer),
               "DATAGEN_DATA_DIR": str(make_partition(tmp, args.prompts, datasets)),
               "DATAGEN_TOKEN_BUDGET": str(args.budget),
               "DATAGEN_SHORT_CONCURRENCY": str(args.workers),
               "DATAGEN_SHORT_MAX_TOKENS": str(args.max_new_tokens),
               "DATAGEN_LEASE_S": "10", "DATAGEN_LOG_EACH_TASK": "true",  # runs: its lines
               **RULES[rule]}
        env.update({f"DATAGEN_{name.upper()}": value
                    for name, _, value in (item.partition("=") for item in args.setting)})
        if args.margin_sd is not None:
            env["DATAGEN_ADMISSION_MARGIN_SD"] = str(args.margin_sd)
        worker = start_worker("short", child_env(env), logs, name=f"bench-{rule}@%h")
        try:
            wait_for_workers(srv.url, 1, procs=[worker])
            settings = load_settings(None, env=env)
            ledger = Ledger.from_settings(settings)
            timeline = Timeline(ledger, datasets)
            timeline.start()
            started = time.time()
            Producer(settings, make_app(settings), ledger).run()
            for dataset in datasets:
                _wait_closed_and_drained(ledger, dataset)
            timeline.stop.set()
            sim_log = requests.get(f"{url}/_sim/log", timeout=30).json()
            # Celery task runs (each logs one "received"), per prompt enqueued: a sample
            # refused admission parks once; only woken ones run again.
            runs = worker.log_text().count("] received")
            return {"rule": rule, "datasets": len(datasets),
                    "task_runs": runs, "prompts": args.prompts * len(datasets),
                    "task_runs_per_sample": runs / (args.prompts * len(datasets)),
                    "per_dataset": [_measure(args, ledger, timeline, sim_log, started, d)
                                    for d in datasets]}
        finally:
            worker.stop()
            sim.stop()


def _wait_closed_and_drained(ledger: Ledger, dataset: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = ledger.snapshot(dataset)
        if snap["closed"] and snap["in_flight"] == 0:
            time.sleep(1.0)  # let stragglers that slipped past land in the log
            return
        time.sleep(0.1)
    raise TimeoutError("dataset did not close")


def _measure(args: argparse.Namespace, ledger: Ledger, timeline: Timeline,
             sim_log: list[dict[str, Any]], started: float, dataset: str) -> dict[str, Any]:
    snap = ledger.snapshot(dataset)
    close_t = next(e["t"] for e in ledger.events(dataset) if e["e"].startswith("closed"))
    starts = [e for e in sim_log if e["event"] == "start" and e.get("dataset") == dataset]
    finished = [e for e in sim_log if e["event"] in ("finish", "abort")
                and e.get("dataset") == dataset]
    generated = sum(int(e.get("completion_tokens") or 0) for e in finished)
    committed = snap["tokens"]
    samples = snap["stats"].get("samples", 0)
    # (The timeline samples every 50 ms: a close within one sample of 95% reads as 0.)
    t95 = min(close_t, timeline.passed(dataset, 0.95 * args.budget, close_t))
    steady = timeline.command_rate(timeline.passed(dataset, 0.2 * args.budget, close_t),
                                   timeline.passed(dataset, 0.8 * args.budget, close_t))
    near = timeline.command_rate(t95, close_t)
    after = [e for e in starts if e["time"] > close_t]
    # The most requests of the dataset the server ran at once (its log's starts and ends).
    steps = sorted([(e["time"], 1) for e in starts] + [(e["time"], -1) for e in finished])
    running = peak = 0
    for _, step in steps:
        running += step
        peak = max(peak, running)
    return {
        "dataset": dataset, "budget": args.budget, "committed": committed,
        "overshoot_pct": 100.0 * (committed - args.budget) / args.budget,
        "mean_response": committed / samples if samples else 0.0,
        "discarded_pct": 100.0 * max(0, generated - committed) / args.budget,
        "samples": samples,
        "requests_after_close": len(after),
        "last_start_after_close_s": max((e["time"] for e in starts), default=close_t) - close_t,
        "from_95pct_to_close_s": close_t - t95,
        "commands_per_s_steady": steady, "commands_per_s_near_close": near,
        "run_s": close_t - started, "peak_in_flight": peak,
    }


def main() -> int:
    args = parse_args()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-budget-") as tmp_name:
        tmp = Path(tmp_name)
        tokenizer = build_tiny_tokenizer(tmp / "tok")
        encoder = ChatEncoder(tokenizer)
        for rnd in range(args.rounds):
            for rule in args.rules.split(","):
                sub = tmp / f"r{rnd}-{rule}"
                sub.mkdir()
                results.append(one_round(args, rule, sub, tokenizer, encoder))
                print(_row(results[-1]), flush=True)
    print_table(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cores": _cores(), "python": platform.python_version()},
        "args": vars(args), "rounds": results}, indent=2))
    return 0


COLUMNS = ("rule", "dataset", "committed", "overshoot_pct", "discarded_pct",
           "requests_after_close", "from_95pct_to_close_s", "commands_per_s_steady",
           "commands_per_s_near_close", "run_s", "peak_in_flight")


def _rows(result: dict[str, Any]) -> list[str]:
    out = []
    for d in result["per_dataset"]:
        cells = {**d, "rule": result["rule"]}
        out.append(" | ".join(_cell(cells[c]) for c in COLUMNS)
                   + f" | {result['task_runs_per_sample']:.2f}")
    return out


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:,.0f}"
    return "-" if value is None else str(value)


def _row(result: dict[str, Any]) -> str:
    return "\n".join(_rows(result))


def print_table(results: list[dict[str, Any]]) -> None:
    print("\n| " + " | ".join(COLUMNS) + " | task runs per prompt |")
    print("|" + "---|" * (len(COLUMNS) + 1))
    for r in results:
        for line in _rows(r):
            print(f"| {line} |")
    for rule in RULES:
        over = [d["overshoot_pct"] for r in results if r["rule"] == rule
                for d in r["per_dataset"]]
        if over:
            print(f"{rule}: median overshoot {statistics.median(over):.3f}%, "
                  f"max {max(over):.3f}%")


def _cores() -> int:
    import os

    return os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
