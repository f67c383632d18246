"""What the training window saves: window-capped generation against today's, side by side.

For each window (train_max_length) two arms run one dataset to the same budget of trainable
tokens (budget_counts = "trainable": the generated tokens inside the window): `capped`
(cap_to_window on: max_new_tokens <= window - prompt) and `today` (cap_to_window off: every
request may run to the seed's caps, 10,240 short and 16,384 long). Real processes on
loopback: a throwaway Redis, one SGLang simulator with the fleet run's output lengths (mean
3,700, sigma 0.5, 0.5 ms a decode step, 364 running), `datagen worker short` (150 threads)
and `long` (32), the fleet run's prompts (~1,075 tiny-tokenizer ids, 10% ~1,700 for the long
queue). Per arm: the simulator's busy time (its engine's simulated seconds of decode steps),
tokens generated (every request the server ran, discarded ones included), the records' and
prompts' bytes on disk, and the wall time from produce to the close.

    .venv/bin/python bench/bench_window.py                        # 1M trainable tokens an arm
    .venv/bin/python bench/bench_window.py --budget 20000 --prompts 60 --windows 2048
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import scale_parts as parts  # noqa: E402
from bench.bench_budget import _wait_closed_and_drained  # noqa: E402
from cli.stack import child_env, start_simulator, start_worker, wait_for_workers  # noqa: E402
from config.settings import load_settings  # noqa: E402
from datagen.celery_app import make_app  # noqa: E402
from datagen.generation.ledger import Ledger  # noqa: E402
from datagen.redis_server import RedisServer  # noqa: E402
from datagen.tokenization.chat import ChatEncoder  # noqa: E402
from datagen.tokenization.tokenizer import build_tiny_tokenizer  # noqa: E402
from producers.producer import Producer  # noqa: E402

DATASET = "B1_window"
ARMS = {"capped": "true", "today": "false"}  # cap_to_window
SIM_ARGS = ["--decode-step-s", "0.0005", "--mean-output-tokens", "3700", "--sigma", "0.5",
            "--max-running-requests", "364", "--seed", "11"]
LONG_THRESHOLD_TOKENS = 1400  # the fleet run's (bench_fleet_scale.py), and its prompts:
SHORT_WORDS = (290, 330)  # ~930-1,060 tiny-tokenizer ids (~3.2 a word)
LONG_WORDS = (500, 560)  # ~1,600-1,800 ids: over LONG_THRESHOLD_TOKENS


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=int, default=1_000_000, help="trainable tokens an arm")
    p.add_argument("--prompts", type=int, default=3000)
    p.add_argument("--windows", default="2048,8192", help="train_max_length of each pair")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "window.json"))
    return p.parse_args()


def disk_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def one_arm(args: argparse.Namespace, window: int, arm: str, tmp: Path, data: Path,
            tokenizer: Path, encoder: ChatEncoder) -> dict[str, Any]:
    logs = tmp / "logs"
    out = tmp / "out"
    with RedisServer(workdir=tmp / "redis") as srv:
        sim, url = start_simulator(logs, [*SIM_ARGS, "--vocab-size", str(encoder.vocab_size),
                                          "--eos-token-id", str(encoder.eos_token_id)],
                                   name=f"sim-{window}-{arm}")
        env = {"DATAGEN_REDIS_URL": srv.url, "DATAGEN_SERVER_URL": url,
               "DATAGEN_OUTPUT_DIR": str(out), "DATAGEN_TOKENIZER_PATH": str(tokenizer),
               "DATAGEN_DATA_DIR": str(data), "DATAGEN_TOKEN_BUDGET": str(args.budget),
               "DATAGEN_BUDGET_COUNTS": "trainable", "DATAGEN_TRAIN_MAX_LENGTH": str(window),
               "DATAGEN_CAP_TO_WINDOW": ARMS[arm],
               "DATAGEN_LONG_THRESHOLD_TOKENS": str(LONG_THRESHOLD_TOKENS),
               "DATAGEN_LEASE_S": "10"}
        workers = [start_worker(q, child_env(env), logs, name=f"{q}-{window}-{arm}@%h")
                   for q in ("short", "long")]
        try:
            wait_for_workers(srv.url, 2, procs=workers)
            settings = load_settings(None, env=env)
            ledger = Ledger.from_settings(settings)
            started = time.time()
            report = Producer(settings, make_app(settings), ledger).run()[0]
            _wait_closed_and_drained(ledger, DATASET)
            close_t = next(e["t"] for e in ledger.events(DATASET) if e["e"].startswith("closed"))
            sim_stats = requests.get(f"{url}/_sim/stats", timeout=30).json()
            snap = ledger.snapshot(DATASET)
            return {"window": window, "arm": arm, "budget": args.budget,
                    "trainable": snap["tokens"], "samples": snap["stats"]["samples"],
                    "generated_committed": snap["stats"]["completion_tokens"],
                    "generated_server": int(sim_stats["tokens_generated"]),
                    "requests_server": int(sim_stats["requests_started"]),
                    "prompt_tokens_server": int(sim_stats["prompt_tokens"]),
                    "busy_s": round(float(sim_stats["decode_s"]), 2),
                    "records_bytes": disk_bytes(out / "records"),
                    "prompts_bytes": disk_bytes(out / "prompts"),
                    "wall_s": round(close_t - started, 1),
                    "skipped_for_window": len(report.window),
                    "caps_inside_window": report.trains}
        finally:
            for proc in (*workers, sim):
                proc.stop()


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["| window | arm | trainable | generated (server) | share that trains | "
             "busy s | records MB | wall s | samples |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        share = r["trainable"] / r["generated_server"] if r["generated_server"] else 0.0
        disk = r["records_bytes"] / 1e6
        lines.append(f"| {r['window']:,} | {r['arm']} | {r['trainable']:,} | "
                     f"{r['generated_server']:,} | {100 * share:.0f}% | {r['busy_s']:,.1f} | "
                     f"{disk:,.1f} | {r['wall_s']:,.1f} | {r['samples']:,} |")
    return "\n".join(lines)


def main() -> int:
    args = parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-window-") as tmp_name:
        tmp = Path(tmp_name)
        tokenizer = build_tiny_tokenizer(tmp / "tok")
        encoder = ChatEncoder(str(tokenizer))
        parts.make_partition(tmp / "partition", args.prompts, names=[DATASET],
                             short_words=SHORT_WORDS, long_words=LONG_WORDS)
        for window in (int(w) for w in args.windows.split(",")):
            for arm in ARMS:
                rows.append(one_arm(args, window, arm, tmp / f"{window}-{arm}",
                                    tmp / "partition", tokenizer, encoder))
                print(json.dumps(rows[-1]), flush=True)
    result = {"rows": rows, "conditions": {
        "host": platform.node(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
        "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "prompts": args.prompts,
        "simulator": " ".join(SIM_ARGS)}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
