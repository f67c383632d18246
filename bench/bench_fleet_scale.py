"""One whole run across hosts, measured from the run itself: produce, generate, merge, prepare.

    .venv/bin/python bench/bench_fleet_scale.py --prompts 1000000     # root: namespaces
    .venv/bin/python bench/bench_fleet_scale.py --quick               # 1,000 prompts (tests)

Hosts are network namespaces on a bridge (tests/net/lab.py): Redis (Debian's redis-server),
the server (one simulator per worker host), two worker hosts each running `datagen worker
short` and `datagen worker long` against their own simulator, and a control host running
`datagen produce`, then `datagen run` until every dataset is finished or closed, then
`datagen merge` and `datagen prepare`. Four datasets: two whose budgets close them about
halfway, two whose budgets let them finish. Prompts ~1,000 tiny-tokenizer ids (10% ~1,700,
for the `long` queue), outputs ~3,700 ids (the simulator's lognormal mean, sigma 0.5).

Read from the run: Redis's peak memory (INFO), the ledger scripts' Redis-side execution
times (SLOWLOG of every command, drained once a second: bench/fleet_parts.py), Celery task
runs per prompt (the workers' logs), each command's wall time and peak RSS (wait4; the
workers' and simulators' VmHWM before they stop), samples/s, budget precision per dataset,
disk written. Everything it creates (namespaces, processes, files) is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from net.lab import Lab, unavailable_reason  # noqa: E402

from bench import fleet_parts as fleet  # noqa: E402
from bench import scale_parts as parts  # noqa: E402
from cli.stack import Process, child_env  # noqa: E402
from config.settings import load_settings  # noqa: E402
from datagen import keys  # noqa: E402
from datagen.generation.ledger import Ledger, connect  # noqa: E402
from datagen.generation.records import records_dir  # noqa: E402
from datagen.tokenization.chat import ChatEncoder  # noqa: E402
from datagen.tokenization.tokenizer import build_tiny_tokenizer  # noqa: E402

REDIS_PORT, SERVER_PORT = 6379, 30000
WORKER_HOSTS = ("w1", "w2")
# Two datasets close at about this share of the tokens their prompts would make; two finish.
DATASETS = {"B1_close": 0.4, "B2_close": 0.6, "B3_full": None, "B4_full": None}
SHORT_WORDS = (290, 330)  # ~930-1,060 tiny-tokenizer ids (~3.2 a word)
LONG_WORDS = (500, 560)  # ~1,600-1,800 ids: over LONG_THRESHOLD_TOKENS
LONG_THRESHOLD_TOKENS = 1400
NO_BUDGET = 10**15


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=lambda x: int(float(x)), default=1_000_000)
    p.add_argument("--quick", action="store_true", help="1,000 prompts, fewer threads (tests)")
    p.add_argument("--decode-step-s", type=float, default=0.0005)
    p.add_argument("--mean-output-tokens", type=float, default=3700.0)
    p.add_argument("--short-concurrency", type=int, default=150)
    p.add_argument("--long-concurrency", type=int, default=32)
    p.add_argument("--workdir", default=None, help="where the run writes (deleted after)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "fleet_scale.json"))
    args = p.parse_args()
    if args.quick:
        args.prompts, args.short_concurrency, args.long_concurrency = 1000, 32, 8
    return args


class FleetRun:
    def __init__(self, args: argparse.Namespace, tmp: Path, lab: Lab):
        self.args, self.tmp, self.lab = args, tmp, lab
        self.out = tmp / "out"
        self.tokenizer = build_tiny_tokenizer(tmp / "tokenizer")
        self.encoder = ChatEncoder(self.tokenizer)
        self.results: dict[str, Any] = {}
        self.sims: list[Process] = []
        self.workers: list[Process] = []

    # -- set-up -----------------------------------------------------------------------------

    def prepare_inputs(self) -> None:
        names = list(DATASETS)
        self.results["partition"] = parts.make_partition(
            self.tmp / "partition", self.args.prompts, names=names,
            short_words=SHORT_WORDS, long_words=LONG_WORDS)
        counts = dict(zip(names, parts.per_dataset(self.args.prompts, len(names)), strict=True))
        self.budgets = {name: round(share * counts[name] * self.args.mean_output_tokens)
                        if share else NO_BUDGET for name, share in DATASETS.items()}
        self.prompts = counts
        config = self.tmp / "fleet.toml"
        # Whole responses counted as generated, as the fleet figures in BENCHMARKS.md were
        # measured (the window's own bench is bench_window.py): the budgets above are sized in
        # generated tokens.
        config.write_text('cap_to_window = false\nbudget_counts = "completion"\n[budgets]\n'
                          + "".join(f"{n} = {b}\n" for n, b in self.budgets.items()))
        self.env = {"DATAGEN_CONFIG": str(config),
                    "DATAGEN_REDIS_URL": f"redis://{self.lab.hosts['redis'].ip}:{REDIS_PORT}/0",
                    "DATAGEN_SERVER_URL": f"http://{self.lab.hosts['server'].ip}:{SERVER_PORT}",
                    "DATAGEN_DATA_DIR": str(self.tmp / "partition"),
                    "DATAGEN_OUTPUT_DIR": str(self.out),
                    "DATAGEN_TOKENIZER_PATH": str(self.tokenizer),
                    "DATAGEN_CONTEXT_LENGTH": str(parts.CONTEXT_LENGTH),
                    "DATAGEN_LONG_THRESHOLD_TOKENS": str(LONG_THRESHOLD_TOKENS),
                    "DATAGEN_SHORT_CONCURRENCY": str(self.args.short_concurrency),
                    "DATAGEN_LONG_CONCURRENCY": str(self.args.long_concurrency),
                    # task_runs counts Celery's per-task lines (workers/task_log.py)
                    "DATAGEN_LOG_EACH_TASK": "true"}

    def start_hosts(self) -> Path:
        for name in ("redis", "server", *WORKER_HOSTS, "control"):
            self.lab.host(name)
        sock = self.lab.start_redis("redis", REDIS_PORT)
        deadline = time.monotonic() + 120
        while not _pings(sock):
            if time.monotonic() > deadline:
                raise RuntimeError("Redis did not answer on its host")
            time.sleep(0.05)
        return sock

    def start_fleet(self, sock: Path) -> None:
        server = self.lab.hosts["server"].ip
        threads = self.args.short_concurrency + self.args.long_concurrency
        for i, host in enumerate(WORKER_HOSTS):
            sim = self.lab.spawn("server", f"sim{i}", [
                sys.executable, "-u", "-m", "simulator", "--host", server,
                "--port", str(SERVER_PORT + i), "--max-running-requests", str(2 * threads),
                "--decode-step-s", str(self.args.decode_step_s),
                "--mean-output-tokens", str(self.args.mean_output_tokens), "--sigma", "0.5",
                "--context-length", str(parts.CONTEXT_LENGTH),
                "--vocab-size", str(self.encoder.vocab_size),
                "--eos-token-id", str(self.encoder.eos_token_id), "--seed", str(i),
                "--log-level", "WARNING"])
            self.lab.wait_log(sim, "SIMULATOR_READY")
            self.sims.append(sim)
            env = child_env(dict(self.env, DATAGEN_SERVER_URL=f"http://{server}:{SERVER_PORT + i}"))
            for queue in ("short", "long"):
                self.workers.append(self.lab.spawn(host, f"{queue}-{host}", [
                    sys.executable, "-m", "cli.main", "worker", queue, "-n",
                    f"{queue}-{host}@%h"], env))
        client = redis.Redis(unix_socket_path=str(sock))
        deadline = time.monotonic() + 600
        while sum(1 for _ in client.scan_iter(match=keys.worker_alive("*"))) < len(self.workers):
            if time.monotonic() > deadline or not all(w.alive() for w in self.workers):
                raise RuntimeError("workers not up: " + "".join(
                    f"\n--- {w.name}:\n{w.log_text()[-1500:]}" for w in self.workers))
            time.sleep(0.2)

    # -- the run ----------------------------------------------------------------------------

    def control(self, args: list[str], log: str) -> dict[str, Any]:
        prefix = ["ip", "netns", "exec", self.lab.hosts["control"].ns]
        return parts.datagen(args, child_env(self.env), self.tmp / "logs" / log, prefix)

    def generate(self, sock: Path) -> None:
        counters = parts.Ledger(f"unix://{sock}")
        pids = {"workers": [w.pid for w in self.workers], "simulators": [s.pid for s in self.sims]}
        sampler = fleet.Sampler(sock, list(DATASETS))
        sampler.start_logging()
        sampler.start()
        try:
            before, cpu_before = counters.counters(), parts.cpu_seconds(pids)
            started = time.monotonic()
            self.results["produce"] = self.control(["produce"], "produce.log")
            self.results["run_command"] = self.control(["run", "--interval", "10"], "run.log")
            seconds = time.monotonic() - started
            after, cpu_after = counters.counters(), parts.cpu_seconds(pids)
            peaks = {p.name: fleet.vm_hwm_mb(p.pid) for p in self.workers + self.sims}
        finally:
            sampler.stop()
        self.results["generate"] = {
            "seconds_produce_start_to_run_end": round(seconds, 1), **sampler.generation(),
            "peak_rss_mb": peaks,
            "cores": {g: round((cpu_after[g] - cpu_before[g]) / seconds, 3) for g in pids},
            "redis": parts.rates(before, after, seconds)}
        self.results["ledger_scripts_redis_side"] = sampler.scripts()
        self.results["slowlog"] = {"entries": sampler.entries, "lost": sampler.lost}
        self.results["load_average_1min"] = sampler.load()
        self.results["celery_tasks"] = fleet.task_runs([w.log_path for w in self.workers])
        for proc in self.workers + self.sims:
            proc.stop(timeout_s=30)

    def finish(self, sock: Path) -> None:
        self.results["merge"] = self.control(["merge"], "merge.log")
        self.results["prepare"] = self.control(["prepare"], "prepare.log")
        memory = redis.Redis(unix_socket_path=str(sock)).info("memory")
        self.results["redis_memory_mb"] = {
            "used_memory_peak": round(memory["used_memory_peak"] / 1e6, 1),
            "used_memory_at_end": round(memory["used_memory"] / 1e6, 1),
            "used_memory_rss_at_end": round(memory["used_memory_rss"] / 1e6, 1)}
        self.results["datasets"] = self.budget_precision(sock)
        manifest = json.loads((self.out / "training" / "manifest.json").read_text())
        self.results["prepare"]["samples"] = manifest["samples"]
        self.results["disk_written_mb"] = {
            "partition": self.results["partition"]["disk_mb"],
            **{p.name: round(parts.disk_bytes(p) / 1e6, 1)
               for p in sorted(self.out.iterdir()) if p.is_dir()},
            "total_output": round(parts.disk_bytes(self.out) / 1e6, 1)}

    def budget_precision(self, sock: Path) -> dict[str, Any]:
        settings = load_settings(None, env=self.env)
        ledger = Ledger(connect(f"unix://{sock}"), settings)
        rows = {}
        for name in DATASETS:
            snap = ledger.snapshot(name)
            merged = _merged(self.out / name / "raw_responses.jsonl")
            stored = sum(parts.count_lines(f) for f in records_dir(self.out, name).glob("*.jsonl"))
            budget = snap["budget"]
            rows[name] = {
                "prompts": self.prompts[name], "budget": budget,
                "tokens": snap["tokens"], "samples": snap["stats"]["samples"],
                "closed": bool(snap["closed"]),
                "over_budget_pct": round(100 * (snap["tokens"] - budget) / budget, 3)
                if budget < NO_BUDGET else None,
                "duplicates_refused": snap["stats"].get("duplicates", 0),
                "reaped": snap["stats"].get("reaped", 0),
                "truncated": snap["stats"].get("truncated", 0),
                "records_stored": stored, **merged, "pending": snap["pending"],
                "in_flight": snap["in_flight"], "dead": snap["dead"], "stats": snap["stats"]}
        return rows


def _merged(path: Path) -> dict[str, int]:
    ids, tokens, lines = set(), 0, 0
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            ids.add(record["id"])
            tokens += record["completion_tokens"]
            lines += 1
    return {"merged": lines, "merged_ids": len(ids), "merged_tokens": tokens}


def _pings(sock: Path) -> bool:
    try:
        return bool(redis.Redis(unix_socket_path=str(sock)).ping())
    except redis.RedisError:
        return False


def check(results: dict[str, Any]) -> list[str]:
    """Every sample counted once: ledger, merged records and training set agree."""
    problems = []
    for name, row in results["datasets"].items():
        if not row["samples"] == row["merged"] == row["merged_ids"]:
            problems.append(f"{name}: {row['samples']} counted, {row['merged']} merged, "
                            f"{row['merged_ids']} distinct")
        if row["tokens"] != row["merged_tokens"]:
            problems.append(f"{name}: {row['tokens']} tokens counted, {row['merged_tokens']} "
                            "in the merged records")
        if row["over_budget_pct"] is None and row["samples"] != row["prompts"]:
            problems.append(f"{name}: {row['samples']} of {row['prompts']} done")
    total = sum(row["samples"] for row in results["datasets"].values())
    if results["prepare"]["samples"] != total or results["generate"]["samples"] != total:
        problems.append(f"prepare {results['prepare']['samples']}, generate "
                        f"{results['generate']['samples']}, ledger {total}")
    return problems


def table(r: dict[str, Any]) -> str:
    gen, scripts = r["generate"], r["ledger_scripts_redis_side"]
    rows = [("prompts", f"{r['prompts']:,} over {len(r['datasets'])} datasets"),
            ("samples counted", f"{gen['samples']:,}"),
            ("load average (1 min) during the run", "{min:.1f} / {median:.1f} / {max:.1f} "
             "(min / median / max)".format(**r["load_average_1min"]))]
    for step in ("produce", "run_command", "merge", "prepare"):
        rows.append((f"{step}: wall, peak RSS",
                     f"{r[step]['seconds']:,.1f} s, {r[step]['peak_rss_mb']:,.0f} MB"))
    rows += [("generate: produce start to run end",
              f"{gen['seconds_produce_start_to_run_end']:,.1f} s"),
             ("generate: samples/s (first to last count)",
              f"{gen['samples_per_s']} ({gen['first_to_last_count_s']} s)"),
             ("workers / simulators peak RSS (VmHWM)",
              ", ".join(f"{k} {v:,.0f} MB" for k, v in gen["peak_rss_mb"].items())),
             ("cores used: workers / simulators / Redis",
              f"{gen['cores']['workers']} / {gen['cores']['simulators']} / "
              f"{gen['redis']['cpu_cores']}"),
             ("Redis used_memory_peak (INFO, slowlog included) / at end", "{used_memory_peak:,} "
              "/ {used_memory_at_end:,} MB".format(**r["redis_memory_mb"])),
             ("Redis used_memory max, sampled each second with the slowlog emptied / the "
              "slowlog's most", f"{gen['redis_used_memory_max_mb']:,} / "
              f"{gen['slowlog_memory_max_mb']:,} MB")]
    for name in ("admit", "commit"):
        s = scripts.get(name, {"calls": 0})
        rows.append((f"{name}.lua Redis-side µs: p50 / p99 / max (calls)",
                     f"{s.get('p50_us')} / {s.get('p99_us')} / {s.get('max_us')} "
                     f"({s['calls']:,})"))
    tasks = r["celery_tasks"]
    outcomes = ", ".join(f"{k} {v:,}" for k, v in tasks["ends"].items())
    rows.append(("Celery task runs per prompt",
                 f"{tasks['received'] / r['prompts']:.3f} ({tasks['received']:,} received: "
                 f"{outcomes}; {tasks['discarded_revoked']:,} revoked, discarded)"))
    for name, d in r["datasets"].items():
        over = "" if d["over_budget_pct"] is None else f", {d['over_budget_pct']:+.3f}% of budget"
        rows.append((f"{name}: samples / prompts, tokens",
                     f"{d['samples']:,} / {d['prompts']:,}, {d['tokens']:,}{over}"))
    rows.append(("disk written", ", ".join(f"{k} {v:,} MB"
                                           for k, v in r["disk_written_mb"].items())))
    return "\n".join(["| figure | value |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows])


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    args = parse_args()
    if reason := unavailable_reason():
        print(f"cannot make hosts here: {reason}")
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # cleaned up as on Ctrl-C
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-", dir=args.workdir) as name:
        tmp = Path(name)
        with Lab(tmp) as lab:
            run = FleetRun(args, tmp, lab)
            sock = run.start_hosts()
            run.prepare_inputs()
            run.start_fleet(sock)
            run.generate(sock)
            run.finish(sock)
    results = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                    time.gmtime()),
               "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
               "bench_pid": os.getpid(),  # its namespaces were named dgn<pid>-...
               "prompts": args.prompts, "decode_step_s": args.decode_step_s,
               "mean_output_tokens": args.mean_output_tokens,
               "threads_per_worker": {"short": args.short_concurrency,
                                      "long": args.long_concurrency},
               "wall_s": round(time.monotonic() - started, 1), **run.results}
    results["problems"] = check(results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"\nwall time {results['wall_s']:.0f} s; results in {args.out}")
    for problem in results["problems"]:
        print(f"PROBLEM: {problem}")
    return 1 if results["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
