"""Ten times the seed: 1,000,000 prompts over 8 datasets, from the enqueue to the training set.

    .venv/bin/python bench/bench_scale.py                       # 1,000,000 prompts and records
    .venv/bin/python bench/bench_scale.py --prompts 20000 --run-samples 3000   # 6.6 min at load 13
    .venv/bin/python bench/bench_scale.py --prompts 100000,300000 --records 100000,300000
        # two sizes: a line through them gives the 1,000,000 figures, labelled extrapolated
    .venv/bin/python bench/bench_scale.py --phases rebuild,merge,prepare --records 1000000

Phases (issue 19 §4), each with the real command in a child process:
  produce   `datagen produce` of N prompts (8 datasets, 10% long) into an empty Redis:
            time, the producer's peak RSS, Redis used_memory after
  rerun     `datagen produce` again with all N pending: it must enqueue nothing; time, RSS
  status    `datagen status` and Flower's API (`datagen flower`) with the backlog
  run       a slice of the backlog through 4 short workers (-c 150) and 4 long (-c 32), each
            short/long pair on a simulator of its own: samples/s, Redis commands/s and CPU
            (INFO commandstats and INFO cpu over the slice), then Flower's API again
  rebuild   `datagen recover` into an emptied Redis with N records on disk (written directly)
  merge     `datagen merge` of those records
  prepare   `datagen prepare` of them (with the tokenizer: conversations too)
Every phase runs at each size given; status and run at the largest only. With two sizes or
more, each figure gets the line through the two largest, and its value at --target when
that is beyond them. Everything the bench writes is deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import scale_parts as parts  # noqa: E402
from bench.scale_run import (  # noqa: E402
    flower_api,
    run_slice,
    start_flower,
    status_in_process,
)
from cli.stack import Process, child_env  # noqa: E402
from datagen import keys  # noqa: E402
from datagen.redis_server import RedisServer  # noqa: E402
from datagen.tokenization.tokenizer import build_tiny_tokenizer  # noqa: E402

PHASES = ("produce", "rerun", "status", "run", "rebuild", "merge", "prepare")
BACKLOG = ("produce", "rerun", "status", "run")
RECORDS = ("rebuild", "merge", "prepare")
# The figures a line is fitted to, per phase: (key, unit) as the table shows them.
FITTED = {"produce": (("seconds", "s"), ("peak_rss_mb", "MB"), ("redis_mb", "MB")),
          "rerun": (("seconds", "s"), ("peak_rss_mb", "MB")),
          "rebuild": (("seconds", "s"), ("peak_rss_mb", "MB"), ("redis_mb", "MB")),
          "merge": (("seconds", "s"), ("peak_rss_mb", "MB")),
          "prepare": (("seconds", "s"), ("peak_rss_mb", "MB"))}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sizes = lambda text: sorted({int(float(x)) for x in text.split(",")})  # noqa: E731
    p.add_argument("--prompts", type=sizes, default=[1_000_000],
                   help="prompts of the backlog; a comma list measures each (default 1000000)")
    p.add_argument("--records", type=sizes, default=None,
                   help="records of rebuild/merge/prepare (default: --prompts)")
    p.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {PHASES}")
    p.add_argument("--target", type=int, default=1_000_000,
                   help="size the fitted lines are read at when beyond the sizes measured")
    p.add_argument("--run-samples", type=int, default=30_000,
                   help="samples in the measured slice of the run phase")
    p.add_argument("--simulators", type=int, default=4, help="one short + one long worker each")
    p.add_argument("--short-concurrency", type=int, default=150)
    p.add_argument("--long-concurrency", type=int, default=32)
    p.add_argument("--decode-step-s", type=float, default=0.002)
    p.add_argument("--mean-output-tokens", type=float, default=64.0)
    p.add_argument("--record-ids", default="128,256", help="prompt,output ids per record")
    p.add_argument("--workdir", default=None, help="where the bench writes (deleted after)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "scale.json"))
    args = p.parse_args()
    args.phases = [x for x in args.phases.split(",") if x]
    unknown = set(args.phases) - set(PHASES)
    if unknown:
        p.error(f"--phases: unknown {sorted(unknown)}; known: {', '.join(PHASES)}")
    args.records = args.records or args.prompts
    args.record_ids = tuple(int(x) for x in args.record_ids.split(","))
    return args


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path):
        self.args, self.tmp = args, tmp
        self.tokenizer = build_tiny_tokenizer(tmp / "tokenizer")
        self.partitions: dict[int, Path] = {}
        self.results: dict[str, Any] = {phase: {"sizes": {}} for phase in args.phases}
        self.setup: dict[str, Any] = {"partitions": {}, "records": {}}

    def env(self, redis_url: str, data_dir: Path, out: Path, **extra: str) -> dict[str, str]:
        return child_env({"DATAGEN_REDIS_URL": redis_url, "DATAGEN_DATA_DIR": str(data_dir),
                          "DATAGEN_OUTPUT_DIR": str(out),
                          "DATAGEN_TOKENIZER_PATH": str(self.tokenizer),
                          "DATAGEN_CONTEXT_LENGTH": str(parts.CONTEXT_LENGTH),
                          "DATAGEN_LONG_THRESHOLD_TOKENS": str(parts.LONG_THRESHOLD_TOKENS),
                          "DATAGEN_TOKEN_BUDGET": str(10**15),  # nothing closes
                          "DATAGEN_LOG_LEVEL": "WARNING", **extra})

    def partition(self, n: int) -> Path:
        if n not in self.partitions:
            root = self.tmp / f"partition-{n}"
            self.setup["partitions"][n] = parts.make_partition(root, n)
            self.partitions[n] = root
        return self.partitions[n]

    def record(self, phase: str, n: int, figures: dict[str, Any]) -> None:
        if phase in self.results:
            self.results[phase]["sizes"][n] = figures
            print(f"  {phase} at {n:,}: {figures}", flush=True)

    # -- produce, rerun, status, run ------------------------------------------------------

    def backlog(self, n: int, largest: bool) -> None:
        case = self.tmp / f"backlog-{n}"
        with RedisServer(workdir=case / "redis") as srv:
            env = self.env(srv.url, self.partition(n), case / "out")
            ledger = parts.Ledger(srv.url)
            before = ledger.used_memory_mb()
            first = parts.datagen(["produce"], env, case / "produce.log")
            queued = {q: ledger.queued(q) for q in ("short", "long")}
            pending = ledger.count(keys.PENDING)
            if pending != n or sum(queued.values()) != n:
                raise SystemExit(f"produce at {n}: {pending} pending, {queued} queued")
            self.record("produce", n, {
                **first, "enqueued": pending, "queued": queued,
                "prompts_per_s": round(n / first["seconds"]),
                "redis_mb": round(ledger.used_memory_mb() - before, 1),
                "redis_bytes_per_prompt": round((ledger.used_memory_mb() - before) * 1e6 / n)})
            if "rerun" in self.args.phases:
                again = parts.datagen(["produce"], env, case / "rerun.log")
                new = ledger.count(keys.PENDING) - pending
                requeued = sum(ledger.queued(q) for q in queued) - sum(queued.values())
                if new or requeued:
                    raise SystemExit(f"rerun at {n}: {new} new pending, {requeued} new tasks")
                self.record("rerun", n, {**again, "pending": n, "enqueued": new + requeued})
            if largest and {"status", "run"} & set(self.args.phases):
                self.operate(n, srv.url, env, ledger, case)
        shutil.rmtree(case)

    def operate(self, n: int, url: str, env: dict[str, str], ledger: parts.Ledger,
                case: Path) -> None:
        statuses = [parts.datagen(["status"], env, case / f"status-{i}.log") for i in range(3)]
        status_json = parts.datagen(["status", "--json"], env, case / "status-json.log")
        inside = [status_in_process(env) for _ in range(3)]
        flower: Process | None = None
        try:
            flower, flower_url, auth = start_flower(env, case / "logs")
            idle = flower_api(flower_url, auth)
            self.record("status", n, {
                "pending": ledger.count(keys.PENDING),
                "status_s": sorted(s["seconds"] for s in statuses),
                "status_peak_rss_mb": max(s["peak_rss_mb"] for s in statuses),
                "status_json_s": status_json["seconds"],
                "status_rows_and_render_s": sorted(x["rows_and_render_s"] for x in inside),
                "status_import_s": sorted(x["import_s"] for x in inside), "flower": idle})
            if "run" in self.args.phases:
                self.record("run", n, run_slice(
                    self.args, env, url, ledger, case / "logs", {"flower": [flower.pid]},
                    after=lambda: {"flower": flower_api(flower_url, auth),
                                   "status": status_in_process(env)}))
        finally:
            if flower is not None:
                flower.stop()

    # -- rebuild, merge, prepare ----------------------------------------------------------

    def records(self, n: int) -> None:
        case = self.tmp / f"records-{n}"
        data_dir = self.partition(n)
        self.setup["records"][n] = parts.write_records(case / "out", n, *self.args.record_ids)
        with RedisServer(workdir=case / "redis") as srv:  # empty: as after a lost Redis
            env = self.env(srv.url, data_dir, case / "out")
            ledger = parts.Ledger(srv.url)
            rebuilt = parts.datagen(["recover"], env, case / "recover.log")
            done, pending = ledger.count(keys.DONE), ledger.count(keys.PENDING)
            if done != n or pending:
                raise SystemExit(f"recover at {n}: {done} done, {pending} pending")
            self.record("rebuild", n, {**rebuilt, "done": done, "enqueued": pending,
                                       "redis_mb": ledger.used_memory_mb()})
            if "merge" in self.args.phases:
                merged = parts.datagen(["merge"], env, case / "merge.log")
                lines = sum(parts.count_lines(case / "out" / name / "raw_responses.jsonl")
                            for name in parts.dataset_names())
                if lines != n:
                    raise SystemExit(f"merge at {n}: {lines} merged records")
                self.record("merge", n, {**merged, "records": lines})
            if "prepare" in self.args.phases:
                prepared = parts.datagen(["prepare"], env, case / "prepare.log")
                manifest = json.loads((case / "out" / "training" / "manifest.json").read_text())
                if manifest["samples"] != n:
                    raise SystemExit(f"prepare at {n}: {manifest['samples']} samples")
                self.record("prepare", n, {
                    **prepared, "samples": manifest["samples"],
                    "shards": len(manifest["shards"]),
                    "written_mb": round(parts.disk_bytes(case / "out" / "training") / 1e6, 1)})
        shutil.rmtree(case)

    def fits(self) -> None:
        for phase, figures in FITTED.items():
            if phase not in self.results:
                continue
            sizes = self.results[phase]["sizes"]
            lines = {key: parts.fit({n: f[key] for n, f in sizes.items()}, self.args.target)
                     for key, _ in figures}
            self.results[phase]["fit"] = {k: v for k, v in lines.items() if v}


def table(results: dict[str, Any], target: int) -> str:
    head = f"| phase | figure | measured | growth per item | at {target:,} |"
    lines = [head, "|---|---|---|---|---|"]
    for phase, (key, unit) in ((p, f) for p, fs in FITTED.items() for f in fs):
        if phase not in results or not results[phase]["sizes"]:
            continue
        sizes = results[phase]["sizes"]
        measured = ", ".join(f"{sizes[n][key]:,.1f} at {n:,}" for n in sorted(sizes))
        line = results[phase].get("fit", {}).get(key)
        growth = _growth(line["per_item"], unit) if line else ""
        at = (f"{sizes[target][key]:,.1f} {unit} (measured)" if target in sizes
              else f"{line['value']:,.1f} {unit} (extrapolated)" if line and "value" in line
              else "not measured")
        lines.append(f"| {phase} | {key} | {measured} | {growth} | {at} |")
    return "\n".join(lines)


def _growth(per_item: float, unit: str) -> str:
    if unit == "s":
        return f"{per_item * 1e6:,.1f} µs"
    return f"{per_item * 1e6:,.0f} bytes"  # MB per item, in bytes


def summary(results: dict[str, Any]) -> str:
    out = []
    for phase in ("status", "run"):
        for n, f in results.get(phase, {}).get("sizes", {}).items():
            out.append(f"{phase} at {n:,} pending: " + json.dumps(f))
    return "\n".join(out)


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=args.workdir) as name:
        bench = Bench(args, Path(name))
        if set(BACKLOG) & set(args.phases):
            for n in args.prompts:
                bench.backlog(n, largest=n == args.prompts[-1])
        if set(RECORDS) & set(args.phases):
            for n in args.records:
                bench.records(n)
        bench.fits()
    wall = time.monotonic() - started
    print(table(bench.results, args.target))
    print(summary(bench.results))
    print(f"\nwall time {wall:.0f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_end": os.getloadavg()},
        "wall_s": round(wall, 1), "target": args.target, "setup": bench.setup,
        "phases": bench.results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
