"""Parts of bench/bench_scale.py: the inputs it writes, the processes it times, the line fit.

The partition and the records are written directly (no tokenizer, no workers) so that a
million of each takes seconds, not the run it stands for. Records are the runner's format
(docs/FORMATS.md) as bench/bench_memory.py writes them (``make_record`` and ``encode``),
for eight datasets whose ids are the partition's, so ``datagen recover`` finds every prompt
done.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
import redis
import requests

from bench.bench_memory import ID_LISTS, WORKER_FILES, id_lists, make_record
from cli.stack import REPO
from datagen import keys
from datagen.generation.index import encode
from datagen.generation.records import records_dir

DATASETS = 8
LONG_SHARE = 0.1  # as the seed's mix (bench_generate: 1,800 short, 200 long)
SHORT_WORDS = (15, 50)  # ~50-160 tiny-tokenizer tokens (~3.2 a word)
LONG_WORDS = (170, 250)  # ~550-800 tokens, over the bench's long_threshold_tokens
LONG_THRESHOLD_TOKENS = 512
CONTEXT_LENGTH = 32768  # the simulator's default


def dataset_names() -> list[str]:
    return [f"B{d + 1}_scale" for d in range(DATASETS)]


def per_dataset(n: int, datasets: int = DATASETS) -> list[int]:
    return [n // datasets + (d < n % datasets) for d in range(datasets)]


def sample_id(d: int, i: int) -> str:
    """Unique over the datasets: prepare drops an id a dataset before took (a collision)."""
    return f"s{d}-{i:07d}"


def make_partition(root: Path, n: int, seed: int = 0, names: Sequence[str] | None = None,
                   short_words: tuple[int, int] = SHORT_WORDS,
                   long_words: tuple[int, int] = LONG_WORDS) -> dict[str, Any]:
    """n plain prompts over the datasets (default: DATASETS of them), LONG_SHARE of them
    for the long queue; each starts with its dataset and number, so no two are the same
    text."""
    started = time.monotonic()
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(5000)]
    names = list(names or dataset_names())
    for d, (name, count) in enumerate(zip(names, per_dataset(n, len(names)), strict=True)):
        folder = root / name
        folder.mkdir(parents=True)
        with open(folder / "a.jsonl", "w", encoding="utf-8", buffering=1 << 20) as fh:
            for i in range(count):
                low, high = long_words if rng.random() < LONG_SHARE else short_words
                words = rng.choices(vocab, k=rng.randint(low, high))
                fh.write(json.dumps({"id": sample_id(d, i),
                                     "prompt": f"{d} {i} " + " ".join(words)}) + "\n")
    return {"prompts": n, "seconds": round(time.monotonic() - started, 2),
            "disk_mb": round(disk_bytes(root) / 1e6, 1)}


def write_records(out: Path, n: int, prompt_ids: int, output_ids: int) -> dict[str, Any]:
    """One record per prompt of ``make_partition(n)``, each dataset's over WORKER_FILES
    worker files, as bench_memory writes them (its id lists, its record)."""
    started = time.monotonic()
    rng = random.Random(n)
    prompts, outputs = id_lists(rng, prompt_ids), id_lists(rng, output_ids)
    t0 = time.time()
    for d, (name, count) in enumerate(zip(dataset_names(), per_dataset(n), strict=True)):
        folder = records_dir(out, name)
        folder.mkdir(parents=True)
        files = [open(folder / f"bench-{w}.jsonl", "w", encoding="utf-8",  # noqa: SIM115
                      buffering=1 << 20) for w in range(WORKER_FILES)]
        try:
            for i in range(count):
                record = make_record(i, 0, prompts, outputs, t0)
                record.update(dataset=name, id=sample_id(d, i))
                files[i % WORKER_FILES].write(encode(record))
        finally:
            for fh in files:
                fh.close()
    return {"records": n, "ids_per_record": [prompt_ids, output_ids],
            "distinct_id_lists": ID_LISTS, "seconds": round(time.monotonic() - started, 2),
            "disk_mb": round(disk_bytes(out / "records") / 1e6, 1)}


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def count_lines(path: Path) -> int:
    lines = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            lines += chunk.count(b"\n")
    return lines


# Runs argv[2:] in a child forked from this small process and writes its wait4 peak RSS to
# argv[1]. Linux carries the pre-exec memory's high-water mark into ru_maxrss across exec,
# and a child forked (or vforked) from the bench starts with the bench's own RSS: measured
# directly, a 40 MB command read as the bench's 300 MB.
RSS_LAUNCHER = """
import json, os, sys
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as fh:
    json.dump({"peak_rss_kb": usage.ru_maxrss}, fh)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def datagen(args: list[str], env: dict[str, str], log: Path, prefix: Sequence[str] = ()
            ) -> dict[str, Any]:
    """``datagen ARGS`` in a child of its own: wall time and peak RSS (``wait4``, through
    RSS_LAUNCHER). ``prefix`` runs it through a command that execs in place
    (``ip netns exec NS``). Interrupted, the command is killed with its process group."""
    usage = log.with_suffix(".rusage.json")
    argv = [*prefix, sys.executable, "-c", RSS_LAUNCHER, str(usage),
            sys.executable, "-m", "cli.main", *args]
    with open(log, "w", encoding="utf-8") as fh:
        started = time.monotonic()
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        seconds = time.monotonic() - started
    if proc.returncode:
        raise SystemExit(f"datagen {' '.join(args)} exited {proc.returncode}; "
                         f"{log}:\n{log.read_text(errors='replace')[-3000:]}")
    peak_kb = json.loads(usage.read_text())["peak_rss_kb"]
    return {"seconds": round(seconds, 3), "peak_rss_mb": round(peak_kb / 1024, 1)}


class Ledger:
    """What the bench reads of Redis: counts summed over the datasets, INFO figures."""

    def __init__(self, url: str):
        self.r = redis.Redis.from_url(url, decode_responses=True)

    def done(self) -> int:
        with self.r.pipeline(transaction=False) as pipe:
            for name in dataset_names():
                pipe.hget(keys.dataset_key(name, keys.STATS), "samples")
            return sum(int(x or 0) for x in pipe.execute())

    def count(self, part: str) -> int:
        with self.r.pipeline(transaction=False) as pipe:
            for name in dataset_names():
                pipe.hlen(keys.dataset_key(name, part))
            return sum(pipe.execute())

    def queued(self, queue: str) -> int:
        with self.r.pipeline(transaction=False) as pipe:
            for name in keys.queue_lists(queue):
                pipe.llen(name)
            return sum(pipe.execute())

    def used_memory_mb(self) -> float:
        return round(self.r.info("memory")["used_memory"] / 1e6, 1)

    def counters(self) -> dict[str, Any]:
        """Redis's own counts: commands by name (those scripts run included), CPU seconds."""
        cpu = self.r.info("cpu")
        stats = {name.removeprefix("cmdstat_"): int(v["calls"])
                 for name, v in self.r.info("commandstats").items()}
        return {"commands": stats, "cpu_s": cpu["used_cpu_user"] + cpu["used_cpu_sys"],
                "processed": int(self.r.info("stats")["total_commands_processed"])}


def rates(before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, Any]:
    calls = {name: after["commands"][name] - before["commands"].get(name, 0)
             for name in after["commands"]}
    top = sorted(((n, c) for n, c in calls.items() if c), key=lambda x: -x[1])[:8]
    return {"commands": sum(calls.values()),
            "commands_per_s": round(sum(calls.values()) / seconds),
            "processed_per_s": round((after["processed"] - before["processed"]) / seconds),
            "script_calls_per_s": round((calls.get("evalsha", 0) + calls.get("eval", 0))
                                        / seconds),
            "top_commands_per_s": {n: round(c / seconds) for n, c in top},
            "cpu_cores": round((after["cpu_s"] - before["cpu_s"]) / seconds, 3)}


def cpu_seconds(pids: dict[str, list[int]]) -> dict[str, float]:
    """User + system CPU seconds of each group of processes (with their children)."""
    out = {}
    for group, members in pids.items():
        total = 0.0
        for pid in members:
            try:
                procs = [psutil.Process(pid)]
                procs += procs[0].children(recursive=True)
                total += sum(sum(p.cpu_times()[:2]) for p in procs)
            except psutil.NoSuchProcess:
                continue
        out[group] = total
    return out


def timed_gets(url: str, paths: list[str], auth: tuple[str, str], repeat: int
               ) -> dict[str, dict[str, Any]]:
    """Median and max answer time of each path, each asked ``repeat`` times."""
    out = {}
    for path in paths:
        times, size = [], 0
        for _ in range(repeat):
            started = time.monotonic()
            reply = requests.get(url + path, auth=auth, timeout=120)
            times.append(time.monotonic() - started)
            reply.raise_for_status()
            size = len(reply.content)
        out[path] = {"median_s": round(statistics.median(times), 4),
                     "max_s": round(max(times), 4), "bytes": size}
    return out


def fit(points: dict[int, float], target: int) -> dict[str, Any] | None:
    """The line through the two largest sizes: growth per item, and its value at target
    when target is beyond them (an extrapolation), else None."""
    if len(points) < 2:
        return None
    (n1, y1), (n2, y2) = sorted(points.items())[-2:]
    slope = (y2 - y1) / (n2 - n1)
    result = {"from_sizes": [n1, n2], "per_item": slope, "intercept": y1 - slope * n1}
    if target > n2:
        result["extrapolated_at"] = target
        result["value"] = round(result["intercept"] + slope * target, 3)
    return result
