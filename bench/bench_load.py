"""Enqueue a large partition: Redis memory per queued prompt and the producer's memory.

    .venv/bin/python bench/bench_load.py                 # 100,000 prompts of ~2K tokens
    .venv/bin/python bench/bench_load.py --prompts 20000 # quicker

Goal (issue 4): the queued work of 100,000 prompts averaging 2K prompt tokens stays
within 200 MB of Redis memory, and the producer's memory does not grow with the
partition (measured as peak RSS at 10% and 100% of the prompts, in two runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from datagen.redis_server import RedisServer  # noqa: E402
from datagen.tokenization.tokenizer import build_tiny_tokenizer  # noqa: E402

PRODUCE = """
import json, resource, time
import redis
from config.settings import load_settings
from datagen.celery_app import make_app
from datagen.generation.ledger import Ledger
from producers.producer import Producer
s = load_settings()
r = redis.Redis.from_url(s.redis_url)
before = r.info("memory")["used_memory"]
t0 = time.monotonic()
reports = Producer(s, make_app(s), Ledger.from_settings(s)).run()
seconds = time.monotonic() - t0
after = r.info("memory")["used_memory"]
print(json.dumps({"enqueued": sum(x.enqueued for x in reports), "seconds": seconds,
                  "redis_bytes": after - before,
                  "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def make_partition(root: Path, n: int, mean_words: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(5000)]
    per_dataset = n // 4
    for d in range(4):
        folder = root / "partition" / f"B{d + 1}_load"
        folder.mkdir(parents=True)
        with open(folder / "a.jsonl", "w") as fh:
            for i in range(per_dataset):
                words = max(10, int(rng.lognormvariate(0, 0.5) * mean_words))
                text = " ".join(rng.choice(vocab) for _ in range(words))
                fh.write(json.dumps({"id": f"{d}-{i:07d}", "prompt": text}) + "\n")
    return root / "partition"


def produce(tmp: Path, n: int, args: argparse.Namespace, tokenizer: Path) -> dict[str, float]:
    with RedisServer(workdir=tmp / f"redis{n}") as srv:
        env = dict(os.environ, DATAGEN_REDIS_URL=srv.url, DATAGEN_TOKENIZER_PATH=str(tokenizer),
                   DATAGEN_OUTPUT_DIR=str(tmp / f"out{n}"), DATAGEN_CONTEXT_LENGTH="65536",
                   DATAGEN_DATA_DIR=str(make_partition(tmp / f"p{n}", n, args.mean_words)),
                   DATAGEN_LOG_LEVEL="WARNING")
        out = subprocess.run([sys.executable, "-c", PRODUCE], cwd=REPO, env=env,
                             capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        result = json.loads(out.stdout.strip().splitlines()[-1])
    result["prompts_per_s"] = result["enqueued"] / result["seconds"]
    result["redis_bytes_per_prompt"] = result["redis_bytes"] / result["enqueued"]
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=100_000)
    p.add_argument("--mean-words", type=int, default=1000,
                   help="words per prompt (~2 tiny-tokenizer tokens per word)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "load.json"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-load-") as name:
        tmp = Path(name)
        tokenizer = build_tiny_tokenizer(tmp / "tok")
        small = produce(tmp, args.prompts // 10, args, tokenizer)
        full = produce(tmp, args.prompts, args, tokenizer)
    rows = [("prompts enqueued", f"{full['enqueued']:,}", ""),
            ("Redis memory for the queued work", f"{full['redis_bytes'] / 1e6:.1f} MB",
             "<= 200 MB at 100,000"),
            ("Redis bytes per queued prompt", f"{full['redis_bytes_per_prompt']:.0f}", ""),
            ("producer prompts/s (incl. tokenization)", f"{full['prompts_per_s']:.0f}", ""),
            (f"producer peak RSS at {small['enqueued']:,}", f"{small['maxrss_mb']:.0f} MB", ""),
            (f"producer peak RSS at {full['enqueued']:,}", f"{full['maxrss_mb']:.0f} MB",
             "flat")]
    print("| metric | value | goal |\n|---|---|---|")
    for row in rows:
        print(f"| {row[0]} | {row[1]} | {row[2]} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
        "small": small, "full": full}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
