"""Generation throughput: the pipeline against a direct asyncio client; producer rate; worker PSS.

    .venv/bin/python bench/bench_generate.py                  # defaults: 3-4 minutes on 2 cores
    .venv/bin/python bench/bench_generate.py --rounds 3 --out /tmp/generate.json
    .venv/bin/python bench/bench_generate.py --phases producer --producer-prompts 5000
    .venv/bin/python bench/bench_generate.py --phases throughput --decode-steps-s 0.002 --rounds 4
    .venv/bin/python bench/bench_generate.py --phases throughput --decode-steps-s 0.002 \
        --short-workers 2 --base-tree /tmp/base      # /tmp/base's code beside this tree's

Everything runs on loopback with real processes: a throwaway Redis, one SGLang simulator and the
`datagen worker short|long` commands an operator runs.

  producer    Producer.run() over short prompts (tokenization included) against a second Redis
              that nobody consumes: prompts/s, and Redis used_memory per queued prompt
  throughput  one prompt set (a) through producer -> short/long queues -> workers, and (b) through
              one aiohttp session with two semaphores posting the same input_ids and
              sampling_params to /generate (the original single-process script), alternately
              a, b, a, b, ... against one simulator reset between runs; its output lengths are a
              function of (seed, prompt ids), so both runs generate the same tokens
  memory      PSS of each worker (and any children), sampled during the (a) runs at the moments
              its ledger in-flight count is at its full concurrency
  http        one thread posting the same /generate body in turn through a requests.Session
              (what the client used before) and through SGLangClient.generate (http.client),
              alternating blocks: CPU per call of each
  --base-tree with --short-workers 2: short1 runs another checkout's code (its .venv linked),
              short2 this tree's, on one queue at one load; each reports its CPU per 1,000 of
              the samples it stored (its records file): a comparison the machine's load moves
              far less than alternating whole runs
  floor       the same worker command and settings with a task that does no work
              (bench/noop_app.py: it holds its thread for the pipeline's median request time,
              0.4 s without the throughput phase, then one INCR), --prompts messages of the
              producer's payload size: the CPU a Celery worker spends per message before the
              task does anything, against the direct client's CPU per sample at that step

The throughput phase runs once per simulator decode step in --decode-steps-s: 7 ms is the
project's setting (~11k tokens/s), 2 ms a fast server (~39k tokens/s) where the queue's own cost
shows. Each run reports the CPU seconds per 1,000 samples of the worker processes (pipeline) and
of the benchmark process (direct client), and the peak requests running at the server.

Where a run's time goes comes from the simulator's request log: lead (first enqueue or POST to
first request at the server), ramp (until every slot runs), steady in-flight, drain (last
finish until the client saw the run done).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import platform
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script (`make bench`) as well as with -m
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import psutil  # noqa: E402
import redis  # noqa: E402
import requests  # noqa: E402

from cli.stack import Process, child_env, start_simulator, start_worker, wait_for_workers  # noqa: E402,I001
from config.settings import Settings, load_settings  # noqa: E402
from datagen import keys  # noqa: E402
from datagen.celery_app import make_app, worker_argv  # noqa: E402
from datagen.generation.follower import follow  # noqa: E402
from datagen.generation.guard import enqueue  # noqa: E402
from datagen.generation.job import Job  # noqa: E402
from datagen.generation.ledger import Ledger  # noqa: E402
from datagen.generation.records import records_dir  # noqa: E402
from datagen.redis_server import RedisServer  # noqa: E402
from datagen.tokenization.chat import ChatEncoder  # noqa: E402
from datagen.tokenization.tokenizer import build_tiny_tokenizer  # noqa: E402
from producers.producer import Producer, classify, server_limits  # noqa: E402

RATIO_GOAL = 0.98
# A fast server (issue 11 section 8): the queue may cost more there, but not much more.
FAST_STEP_S, FAST_RATIO_GOAL = 0.002, 0.95
CPU_RATIO_GOAL = 2.0  # worker CPU per sample against the direct client's
PRODUCER_GOAL = 2000.0
MB = 1024 * 1024
WORDS = """the of and to in a is that for it as was with be by on not this are or from at which
have an they you were there been one all we their has would when if so will more can about out up
some could what into than time only other new people two first then like now over such our even
most made after also many before through where much way well should each just how little state
good very make world still own see work long get here between both life being under never day
same know while last might great old year come since against right used take three house during
without again place explain describe compare write solve compute find show check list choose build
design number data model token prompt answer question problem value result function method class
return string file line error test table query server request queue worker budget dataset sample
length memory speed output input batch step order level water light city country history story
music river mountain market price energy science""".split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="(a, b) pairs in the throughput phase")
    p.add_argument("--prompts", type=int, default=2000, help="prompt set of the throughput phase")
    p.add_argument("--long-fraction", type=float, default=0.10)
    p.add_argument("--short-concurrency", type=int, default=150)
    p.add_argument("--long-concurrency", type=int, default=32)
    p.add_argument("--short-workers", type=int, default=1,
                   help="short worker processes, each with short-concurrency / N threads")
    # Simulator: 182 requests in flight out of 192 slots, ~11k tokens/s, ~35 s per run.
    p.add_argument("--max-running-requests", type=int, default=192)
    p.add_argument("--decode-steps-s", default="0.007,0.002",
                   help="comma list of simulator decode steps; the throughput phase runs at each")
    p.add_argument("--batch-slowdown", type=float, default=1.0)
    p.add_argument("--prefill-tokens-per-s", type=float, default=20000.0)
    p.add_argument("--mean-output-tokens", type=float, default=200.0)
    p.add_argument("--sigma", type=float, default=0.5, help="lognormal sigma of output lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--producer-prompts", type=int, default=20000)
    p.add_argument("--phases", default="producer,throughput",
                   help="comma list of producer, throughput, http, floor (memory is sampled "
                        "in throughput; floor compares with throughput's direct client)")
    p.add_argument("--http-calls", type=int, default=200, help="calls per block, http phase")
    p.add_argument("--run-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "generate.json"))
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (logs, records)")
    p.add_argument("--base-tree", help="with --short-workers 2: short1 runs the code of this "
                   "checkout (its .venv linked), short2 this tree's, side by side on one queue "
                   "and one load; each run reports both workers' CPU per 1,000 of their own "
                   "samples")
    args = p.parse_args(argv)
    if args.base_tree and args.short_workers != 2:
        p.error("--base-tree compares two short workers: pass --short-workers 2")
    args.decode_steps_s = [float(x) for x in args.decode_steps_s.split(",")]
    args.decode_step_s = args.decode_steps_s[0]  # the step of the simulator now running
    return args


# -- prompts --------------------------------------------------------------------------------

def prose(rng: random.Random, words: int) -> str:
    out: list[str] = []
    for i in range(words):
        word = str(rng.randint(0, 99_999)) if rng.random() < 0.04 else rng.choice(WORDS)
        out.append(word.capitalize() if i == 0 or out[-1].endswith(".") else word)
        if rng.random() < 0.08:
            out[-1] += rng.choice(".,.?:")
    return " ".join(out)


def make_rows(count: int, long_fraction: float, seed: int) -> list[dict[str, Any]]:
    """Chat prompts of 50-300 words; long_fraction of them 2,200-3,000 words (> 2,048 tokens)."""
    rng = random.Random(seed)
    long_ids = set(rng.sample(range(count), round(count * long_fraction)))
    rows = []
    for i in range(count):
        low, high = (2200, 3000) if i in long_ids else (50, 300)
        rows.append({"id": f"s{seed}-{i:06d}",
                     "messages": [{"role": "user", "content": prose(rng, rng.randint(low, high))}]})
    return rows


def write_partition(root: Path, dataset: str, rows: list[dict[str, Any]]) -> Path:
    path = root / dataset / "prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in rows)
    return root


# -- the stack ------------------------------------------------------------------------------

@dataclass
class Bench:
    args: argparse.Namespace
    tmp: Path
    encoder: ChatEncoder
    tokenizer: Path
    redis: RedisServer
    sim: Process | None = None
    sim_url: str = ""
    env: dict[str, str] = field(default_factory=dict)
    workers: dict[str, Process] = field(default_factory=dict)
    procs: list[Process] = field(default_factory=list)

    @property
    def settings(self) -> Settings:
        return load_settings(None, env=self.env)

    def start_simulator(self) -> None:
        a = self.args
        self.sim, self.sim_url = start_simulator(self.tmp / "logs", [
            "--max-running-requests", str(a.max_running_requests),
            "--decode-step-s", str(a.decode_step_s), "--batch-slowdown", str(a.batch_slowdown),
            "--prefill-tokens-per-s", str(a.prefill_tokens_per_s),
            "--mean-output-tokens", str(a.mean_output_tokens), "--sigma", str(a.sigma),
            "--seed", str(a.seed), "--vocab-size", str(self.encoder.vocab_size),
            "--eos-token-id", str(self.encoder.eos_token_id), "--log-level", "WARNING"],
            name=f"simulator-{step_label(a.decode_step_s)}")  # a log (and ready line) of its own
        self.procs.append(self.sim)
        self.env = {"DATAGEN_REDIS_URL": self.redis.url, "DATAGEN_SERVER_URL": self.sim_url,
                    "DATAGEN_OUTPUT_DIR": str(self.tmp / "out"),
                    "DATAGEN_TOKENIZER_PATH": str(self.tokenizer),
                    "DATAGEN_SHORT_CONCURRENCY": str(a.short_concurrency),
                    "DATAGEN_LONG_CONCURRENCY": str(a.long_concurrency),
                    "DATAGEN_TOKEN_BUDGET": str(10**15),  # never closes
                    # The direct client sends every prompt with classify's max_new_tokens;
                    # the window's cap would skip the long prompts (over train_max_length)
                    # in the pipeline alone, and the two would not run the same requests.
                    "DATAGEN_CAP_TO_WINDOW": "false"}

    def start_workers(self) -> None:
        for name, threads in self.worker_limits().items():
            queue = name.rstrip("0123456789")
            env = child_env(dict(self.env,
                                 **{f"DATAGEN_{queue.upper()}_CONCURRENCY": str(threads)}))
            if name == "short1" and self.args.base_tree:
                proc = self._start_base_worker(queue, env, name)
            else:
                proc = start_worker(queue, env, self.tmp / "logs", name=f"{name}@bench")
            self.workers[name] = proc
            self.procs.append(proc)
        wait_for_workers(self.redis.url, len(self.workers), procs=list(self.workers.values()))

    def _start_base_worker(self, queue: str, env: dict[str, str], name: str) -> Process:
        """``datagen worker`` from --base-tree: its folder the working directory and the whole
        PYTHONPATH, so it imports that tree's code only (exec keeps the pid)."""
        base = str(Path(self.args.base_tree).resolve())
        argv = ["/bin/sh", "-c", 'cd "$0" && exec "$@"', base, f"{base}/.venv/bin/python", "-m",
                "cli.main", "worker", queue, "-n", f"{name}@bench"]
        return Process(name, argv, self.tmp / "logs" / f"worker-{name}.log",
                       dict(env, PYTHONPATH=base))

    def samples_by_worker(self, dataset: str) -> dict[str, int]:
        """Records each worker stored of ``dataset``: its records file is named
        "<host>-<pid>-<random>.jsonl" (ledger.owner_id)."""
        folder = records_dir(self.tmp / "out", dataset)
        return {name: sum(sum(1 for _ in open(f, "rb"))
                          for f in folder.glob(f"*-{proc.pid}-*.jsonl"))
                for name, proc in self.workers.items()}

    def limits(self) -> dict[str, int]:
        return {"short": self.args.short_concurrency, "long": self.args.long_concurrency}

    def worker_limits(self) -> dict[str, int]:
        """Threads per worker process: the short queue's concurrency split over N processes
        (their sum is the queue's limit, so the server sees the same requests in flight)."""
        n, total = self.args.short_workers, self.args.short_concurrency
        if n == 1:
            return self.limits()
        split = {f"short{i + 1}": total // n + (i < total % n) for i in range(n)}
        return {**split, "long": self.args.long_concurrency}

    def pids(self) -> dict[str, int]:
        pids = {"simulator": self.sim.pid, "redis": self.redis.proc.pid, "bench": os.getpid()}
        pids.update({f"worker_{q}": p.pid for q, p in self.workers.items()})
        return pids

    def sim_get(self, path: str) -> Any:
        return requests.get(self.sim_url + path, timeout=30).json()

    def sim_reset(self) -> None:
        requests.post(self.sim_url + "/_sim/reset", timeout=10).raise_for_status()

    def stop_workers(self) -> None:
        for proc in self.workers.values():
            proc.stop(timeout_s=10)
            self.procs.remove(proc)
        self.workers = {}

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout_s=10)
        self.procs, self.workers, self.sim = [], {}, None


# -- measuring one run ----------------------------------------------------------------------

def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: round(after[name] - before[name], 3) for name in before}


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        try:
            procs = [psutil.Process(pid)]
            if pid != os.getpid():  # the benchmark's children are counted on their own
                procs += procs[0].children(recursive=True)
            out[name] = sum(sum(p.cpu_times()[:2]) for p in procs)
        except psutil.NoSuchProcess:
            out[name] = 0.0
    t = psutil.cpu_times()
    out["machine_busy"] = t.user + t.nice + t.system + t.irq + t.softirq
    out["machine_steal"] = t.steal
    return out


def cores_used(before: dict[str, float], after: dict[str, float], wall_s: float
               ) -> dict[str, float]:
    cores = {name: round((after[name] - before[name]) / wall_s, 3) for name in before}
    # Other jobs on the machine: busy cores that none of the benchmark's processes used.
    ours = sum(v for k, v in cores.items() if not k.startswith("machine"))
    cores["others"] = round(cores["machine_busy"] - ours, 3)
    return cores


def pss_mb(pid: int) -> float:
    proc = psutil.Process(pid)
    return sum(p.memory_full_info().pss for p in [proc, *proc.children(recursive=True)]) / MB


class Monitor(threading.Thread):
    """Simulator CPU every 0.5 s; with a dataset, each worker's in-flight count and PSS."""

    def __init__(self, bench: Bench, dataset: str | None = None):
        super().__init__(name="bench-monitor", daemon=True)
        self.bench, self.dataset = bench, dataset
        self.ledger = Ledger.from_settings(bench.settings) if dataset else None
        self.sim_cpu: list[float] = []
        self.pss: dict[str, list[tuple[int, float]]] = {q: [] for q in bench.workers}
        self._halt = threading.Event()
        self._sim = psutil.Process(bench.sim.pid)
        self._cpu0 = cpu_seconds(bench.pids())

    def run(self) -> None:
        self._sim.cpu_percent(None)
        ticks = 0
        while not self._halt.wait(0.5):
            try:
                self.sim_cpu.append(self._sim.cpu_percent(None))
                ticks += 1
                if self.ledger is not None and ticks % 4 == 0:
                    self._sample_workers()
            except psutil.Error:  # a process went away: the run is being torn down
                return

    def _sample_workers(self) -> None:
        entries = self.ledger.in_flight(self.dataset).values()
        for queue, proc in self.bench.workers.items():
            # A worker's id in the ledger is "<host>-<pid>-<random>" (ledger.owner_id).
            in_flight = sum(1 for e in entries if f"-{proc.pid}-" in str(e.get("worker")))
            self.pss[queue].append((in_flight, round(pss_mb(proc.pid), 1)))

    def finish(self, wall_s: float, tokens: int) -> dict[str, Any]:
        self._halt.set()
        self.join()
        stats = self.bench.sim_get("/_sim/stats")
        cpu1 = cpu_seconds(self.bench.pids())
        return {"wall_s": round(wall_s, 3), "tokens": tokens,
                "tokens_per_s": round(tokens / wall_s, 1),
                "cores_used": cores_used(self._cpu0, cpu1, wall_s),
                "cpu_s": cpu_delta(self._cpu0, cpu1),
                "sim_cpu_peak_pct": max(self.sim_cpu, default=0.0),
                "sim_tokens_generated": stats["tokens_generated"],
                "sim_requests_finished": stats["requests_finished"],
                "sim_peak_running": stats["peak_running"]}


def occupancy(log: list[dict[str, Any]], begin: float, end: float, limit: int
              ) -> dict[str, Any]:
    """Lead, ramp, steady in-flight and drain of one run from the simulator's request log."""
    steps = sorted((e["time"], 1 if e["event"] == "start" else -1) for e in log
                   if e["event"] in ("start", "finish", "abort"))
    if not steps:
        return {}
    first, last_start = steps[0][0], max(t for t, d in steps if d > 0)
    level, area, steady, full_at, prev = 0, 0.0, 0.0, None, first
    for t, delta in steps:
        area += level * (t - prev)
        if full_at is not None and prev < last_start:
            steady += level * (min(t, last_start) - prev)
        level += delta
        prev = t
        if full_at is None and level >= limit:
            full_at = t
    span = steps[-1][0] - first
    window = last_start - (full_at or last_start)
    starts = {e["rid"]: e["time"] for e in log if e["event"] == "start"}
    durations = [e["time"] - starts[e["rid"]] for e in log
                 if e["event"] == "finish" and e["rid"] in starts]
    return {"lead_s": round(first - begin, 3),
            "ramp_s": round(full_at - first, 3) if full_at else None,  # None: never full
            "steady_in_flight": round(steady / window, 2) if window > 0 else None,
            "mean_in_flight": round(area / span, 2), "server_span_s": round(span, 3),
            "request_s_median": round(statistics.median(durations), 4) if durations else None,
            "drain_s": round(end - steps[-1][0], 3)}


# -- (a) the pipeline -----------------------------------------------------------------------

def run_pipeline(bench: Bench, rows: list[dict[str, Any]], rnd: int) -> dict[str, Any]:
    # A fresh dataset each round and setting; earlier rounds' ledgers stay.
    dataset = f"gen_{step_label(bench.args.decode_step_s).replace('.', 'p')}_r{rnd}"
    settings = bench.settings.replace(data_dir=str(write_partition(
        bench.tmp / f"partition-{rnd}", dataset, rows)))
    app, ledger = make_app(settings), Ledger.from_settings(settings)
    producer = Producer(settings, app, ledger)  # loads the tokenizer: not timed
    first_send = _first_send_clock(app)
    bench.sim_reset()
    monitor = Monitor(bench, dataset)
    monitor.start()
    started = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()):
        reports = producer.run()
        follow(ledger, 0.05, app=app, timeout_s=bench.args.run_timeout_s)
    ended, ended_clock = time.monotonic(), time.time()
    snap = ledger.snapshot(dataset)
    # Generated tokens, as the direct client sums them: the budget's count ("tokens") is
    # the trainable share with budget_counts "trainable", and would deflate the ratio.
    out = monitor.finish(ended - first_send[0], int(snap["stats"].get("completion_tokens", 0)))
    out.update(mode="pipeline", round=rnd, wall_from_producer_start_s=round(ended - started, 3),
               server=occupancy(bench.sim_get("/_sim/log"), first_send[1], ended_clock,
                                sum(bench.limits().values())),
               samples=int(snap["stats"].get("samples", 0)), dead=snap["dead"],
               cpu_s_per_1000=per_1000(out["cpu_s"], snap["stats"].get("samples", 0),
                                       [f"worker_{name}" for name in bench.workers]),
               short=sum(r.short for r in reports), long=sum(r.long for r in reports),
               pss_samples=monitor.pss)
    if bench.args.base_tree:
        samples = bench.samples_by_worker(dataset)
        out["side_by_side"] = {
            name: {"tree": bench.args.base_tree if name == "short1" else "this tree",
                   "samples": samples[name],
                   "cpu_s_per_1000": per_1000(out["cpu_s"], samples[name], [f"worker_{name}"])}
            for name in ("short1", "short2")}
    app.close()
    return out


def _first_send_clock(app: Any) -> list[float]:
    """Wrap this app's send_task to note [monotonic, wall clock] of the first enqueue."""
    first: list[float] = []
    send = app.send_task

    def timed(*args: Any, **kwargs: Any) -> Any:
        if not first:
            first.extend((time.monotonic(), time.time()))
        return send(*args, **kwargs)

    app.send_task = timed
    return first


# -- (b) the direct client ------------------------------------------------------------------

def direct_jobs(bench: Bench, rows: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(queue, /generate body) per prompt, with the producer's tokenization and classification."""
    settings = bench.settings
    ctx_len = server_limits(settings)
    jobs = []
    for ids in bench.encoder.encode_batch([row["messages"] for row in rows]):
        plan = classify(settings, len(ids), ctx_len)
        params = dict(settings.sampling_params, max_new_tokens=plan.max_new_tokens)
        jobs.append((plan.queue, {"input_ids": ids, "sampling_params": params}))
    return jobs


async def _post_all(url: str, jobs: list[tuple[str, dict[str, Any]]],
                    limits: dict[str, int]) -> tuple[list[Any], float, float]:
    import aiohttp  # noqa: PLC0415 (only this phase needs it)

    sems = {queue: asyncio.Semaphore(n) for queue, n in limits.items()}
    connector = aiohttp.TCPConnector(limit=0)  # its default of 100 would cap the concurrency
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        async def one(queue: str, body: dict[str, Any]) -> int:
            async with sems[queue], session.post(url + "/generate", json=body) as resp:
                resp.raise_for_status()
                data = await resp.json()
            return int(data["meta_info"]["completion_tokens"])

        started, clock = time.monotonic(), time.time()
        results = await asyncio.gather(*(one(q, b) for q, b in jobs), return_exceptions=True)
        return results, time.monotonic() - started, clock


def run_direct(bench: Bench, jobs: list[tuple[str, dict[str, Any]]], rnd: int) -> dict[str, Any]:
    bench.sim_reset()
    monitor = Monitor(bench)
    monitor.start()
    results, wall, clock = asyncio.run(_post_all(bench.sim_url, jobs, bench.limits()))
    out = monitor.finish(wall, sum(r for r in results if isinstance(r, int)))
    done = sum(1 for r in results if isinstance(r, int))
    out.update(mode="direct", round=rnd, failed=len(results) - done,
               cpu_s_per_1000=per_1000(out["cpu_s"], done, ["bench"]),
               server=occupancy(bench.sim_get("/_sim/log"), clock, clock + wall,
                                sum(bench.limits().values())))
    return out


def per_1000(cpu_s: dict[str, float], samples: float, names: list[str]) -> float:
    """CPU seconds per 1,000 samples of the client processes: the workers (pipeline) or
    this process (direct client; its monitor thread's small share included)."""
    return round(1000 * sum(cpu_s[n] for n in names) / max(1.0, float(samples)), 3)


def step_label(step_s: float) -> str:
    return f"{step_s * 1000:g}ms"


# -- the producer alone ---------------------------------------------------------------------

def bench_producer(bench: Bench) -> dict[str, Any]:
    count = bench.args.producer_prompts
    part = write_partition(bench.tmp / "partition-producer", "producer",
                           make_rows(count, 0.0, bench.args.seed + 1))
    with RedisServer(workdir=bench.tmp / "redis-producer") as server:
        settings = bench.settings.replace(redis_url=server.url, data_dir=str(part),
                                          output_dir=str(bench.tmp / "out-producer"))
        app, ledger = make_app(settings), Ledger.from_settings(settings)
        producer = Producer(settings, app, ledger)  # tokenizer load, /server_info: not timed
        client = redis.Redis.from_url(server.url)
        before = client.info("memory")["used_memory"]
        started = time.monotonic()
        enqueued = sum(r.enqueued for r in producer.run())
        wall = time.monotonic() - started
        after = client.info("memory")["used_memory"]
        by_key = {name: client.memory_usage(key, samples=0) or 0 for name, key in
                  (("queue", "short"), ("pending", ledger.k("producer", keys.PENDING)))}
        message = client.lindex("short", 0) or b""
        app.close()
        client.close()
    per = max(1, enqueued)
    return {"prompts": count, "enqueued": enqueued, "wall_s": round(wall, 3),
            "prompts_per_s": round(enqueued / wall, 1),
            "redis_used_memory_delta_bytes": after - before,
            "redis_bytes_per_queued_prompt": round((after - before) / per, 1),
            "redis_bytes_per_prompt_by_key": {k: round(v / per, 1) for k, v in by_key.items()},
            "queue_message_bytes": len(message)}


# -- the report -----------------------------------------------------------------------------

def summarize(runs: list[dict[str, Any]], limits: dict[str, int]) -> dict[str, Any]:
    pipe = [r for r in runs if r["mode"] == "pipeline"]
    direct = [r for r in runs if r["mode"] == "direct"]
    pairs = list(zip(pipe, direct, strict=True))
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in pairs]
    cpu_ratios = [a["cpu_s_per_1000"] / max(b["cpu_s_per_1000"], 1e-9) for a, b in pairs]
    return {"ratios": [round(x, 4) for x in ratios],
            "median_ratio": round(statistics.median(ratios), 4),
            "pipeline_tokens_per_s": statistics.median(r["tokens_per_s"] for r in pipe),
            "direct_tokens_per_s": statistics.median(r["tokens_per_s"] for r in direct),
            "worker_cpu_s_per_1000": [r["cpu_s_per_1000"] for r in pipe],
            "direct_cpu_s_per_1000": [r["cpu_s_per_1000"] for r in direct],
            "cpu_ratios": [round(x, 2) for x in cpu_ratios],
            "median_cpu_ratio": round(statistics.median(cpu_ratios), 2),
            "peak_running": {"pipeline": [r["sim_peak_running"] for r in pipe],
                             "direct": [r["sim_peak_running"] for r in direct]},
            "sim_cpu_mean_pct_worst_run": max(100 * r["cores_used"]["simulator"] for r in runs),
            "sim_cpu_peak_pct": max(r["sim_cpu_peak_pct"] for r in runs),
            "memory": memory_summary(pipe, limits), "runs": runs}


def memory_summary(runs: list[dict[str, Any]], limits: dict[str, int]) -> dict[str, Any]:
    """PSS of each worker at the samples where it held its full concurrency in flight."""
    out: dict[str, Any] = {}
    for queue, limit in limits.items():
        samples = [s for r in runs for s in r["pss_samples"].get(queue, [])]
        full = [pss for n, pss in samples if n >= limit]
        out[queue] = {"concurrency": limit, "samples_at_full": len(full),
                      "max_in_flight_seen": max((n for n, _ in samples), default=0),
                      "pss_mb_at_full_min": min(full) if full else None,
                      "pss_mb_at_full_max": max(full) if full else None}
    return out


def table(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    for label, tp in results.get("throughput", {}).items():
        rows += throughput_rows(label, tp)
    if http := results.get("http"):
        m = http["median_cpu_ms_per_call"]
        rows.append(("/generate CPU ms per call: requests.Session / SGLangClient",
                     f"{m['requests']:.3f} / {m['client']:.3f}", "", ""))
    for label, fl in results.get("floor", {}).items():
        rows.append((f"[{label}] no-op worker CPU s per 1,000 tasks (held {fl['hold_s']}s)",
                     f"{fl['worker_cpu_s_per_1000']:.3f}", "", ""))
        if "floor_over_direct" in fl:
            ratio = fl["floor_over_direct"]
            # Not a goal of its own: what the goal leaves for the task's work is the rest.
            rows.append((f"[{label}] no-op worker / direct client CPU per sample",
                         f"{ratio:.2f} (leaves {CPU_RATIO_GOAL - ratio:.2f} of "
                         f"{CPU_RATIO_GOAL:g} for the task)", "", ""))
    if prod := results.get("producer"):
        rows.append(_goal("producer prompts/s incl. tokenization", prod["prompts_per_s"],
                          PRODUCER_GOAL, ",.0f"))
        rows.append(("Redis used_memory per queued prompt (bytes)",
                     f"{prod['redis_bytes_per_queued_prompt']:,.0f}", "", ""))
    return rows


def throughput_rows(label: str, tp: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    goal = FAST_RATIO_GOAL if label == step_label(FAST_STEP_S) else RATIO_GOAL
    rows = [(f"[{label}] pipeline tokens/s (median)", f"{tp['pipeline_tokens_per_s']:,.0f}",
             "", ""),
            (f"[{label}] direct client tokens/s (median)", f"{tp['direct_tokens_per_s']:,.0f}",
             "", "")]
    rows += [(f"[{label}] ratio pipeline/direct, round {i}", f"{x:.3f}", "", "")
             for i, x in enumerate(tp["ratios"], 1)]
    rows.append(_goal(f"[{label}] ratio pipeline/direct, median", tp["median_ratio"], goal, ".3f"))
    rows.append((f"[{label}] CPU s per 1,000 samples: workers / direct client",
                 f"{_span(tp['worker_cpu_s_per_1000'])} / {_span(tp['direct_cpu_s_per_1000'])}",
                 "", ""))
    ratio = tp["median_cpu_ratio"]
    rows.append((f"[{label}] CPU per sample workers/direct, median", f"{ratio:.2f}",
                 f"<= {CPU_RATIO_GOAL:.2f}", "yes" if ratio <= CPU_RATIO_GOAL else "NO"))
    peaks = tp["peak_running"]
    rows.append((f"[{label}] peak running at the server: pipeline / direct",
                 f"{_span(peaks['pipeline'])} / {_span(peaks['direct'])}", "", ""))
    for queue, mem in tp["memory"].items():
        low, high = mem["pss_mb_at_full_min"], mem["pss_mb_at_full_max"]
        rows.append((f"[{label}] {queue} worker PSS at {mem['concurrency']} in flight (MB)",
                     f"{low:.0f}-{high:.0f}" if high else "n/a", "", ""))
    peak = tp["sim_cpu_peak_pct"]
    rows.append((f"[{label}] simulator CPU, worst run mean / 0.5 s peak (% of a core)",
                 f"{tp['sim_cpu_mean_pct_worst_run']:.0f} / {peak:.0f}", "< 100",
                 "yes" if peak < 90 else "NO"))
    return rows


def _span(values: list[float]) -> str:
    """Median and range: '3.31 (3.10-3.52)'."""
    low, high = min(values), max(values)
    return f"{statistics.median(values):g} ({low:g}-{high:g})" if low != high else f"{low:g}"


def _goal(name: str, value: float, goal: float, fmt: str) -> tuple[str, str, str, str]:
    return (name, format(value, fmt), f">= {format(goal, fmt)}", "yes" if value >= goal else "NO")


def print_table(rows: list[tuple[str, str, str, str]]) -> None:
    head = ("metric", "value", "goal", "met")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    for row in [head, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def print_run(r: dict[str, Any]) -> None:
    s = r["server"]
    print(f"round {r['round']} {r['mode']:<8} {r['tokens']:>9,} tokens in {r['wall_s']:5.1f}s = "
          f"{r['tokens_per_s']:>7,.0f} tokens/s; lead {s['lead_s']}s, ramp {s['ramp_s']}s, "
          f"steady in flight {s['steady_in_flight']}, drain {s['drain_s']}s; "
          f"peak running {r['sim_peak_running']}; {r['cpu_s_per_1000']:.2f} CPU s/1k samples; "
          f"other jobs {r['cores_used']['others']:.2f} cores", flush=True)
    for name, w in r.get("side_by_side", {}).items():
        print(f"  {name} ({w['tree']}): {w['samples']:,} samples, {w['cpu_s_per_1000']:.2f} CPU s "
              "per 1,000 of them", flush=True)


# -- main -----------------------------------------------------------------------------------

def run_phases(bench: Bench, phases: set[str]) -> dict[str, Any]:
    """The producer once; the throughput phase once per decode step, each with a simulator
    and workers of its own."""
    results: dict[str, Any] = {}
    for step in bench.args.decode_steps_s:
        bench.args.decode_step_s = step
        try:
            bench.start_simulator()
            if "producer" in phases and "producer" not in results:
                print(f"producer: {bench.args.producer_prompts:,} prompts, no consumer ...",
                      flush=True)
                results["producer"] = bench_producer(bench)
            if "throughput" in phases:
                print(f"throughput at decode step {step_label(step)} ...", flush=True)
                results.setdefault("throughput", {})[step_label(step)] = bench_throughput(bench)
            if "http" in phases and "http" not in results:
                print("http: requests.Session against SGLangClient ...", flush=True)
                results["http"] = bench_http(bench)
            if "floor" in phases:
                print(f"floor at decode step {step_label(step)} ...", flush=True)
                tp = results.get("throughput", {}).get(step_label(step))
                results.setdefault("floor", {})[step_label(step)] = bench_floor(bench, tp)
        finally:
            bench.stop()
    return results


def bench_throughput(bench: Bench) -> dict[str, Any]:
    rows = make_rows(bench.args.prompts, bench.args.long_fraction, bench.args.seed)
    jobs = direct_jobs(bench, rows)
    bench.start_workers()
    runs = []
    for rnd in range(1, bench.args.rounds + 1):
        runs.append(run_pipeline(bench, rows, rnd))
        print_run(runs[-1])
        runs.append(run_direct(bench, jobs, rnd))
        print_run(runs[-1])
    return summarize(runs, bench.worker_limits())


def bench_http(bench: Bench, blocks: int = 4) -> dict[str, Any]:
    """CPU per /generate call in one thread: requests.Session against SGLangClient."""
    from datagen.client import SGLangClient, new_rid  # noqa: PLC0415

    client = SGLangClient(bench.sim_url)
    session = requests.Session()
    # Short, so that the simulator's prefill and decode do not make the phase long.
    body = {"input_ids": list(range(100, 300)),
            "sampling_params": {"temperature": 0.7, "max_new_tokens": 4}, "stream": False}

    def via_requests() -> None:
        resp = session.post(bench.sim_url + "/generate", json=dict(body, rid=new_rid("http")),
                            headers={"X-Datagen-Dataset": "http"}, timeout=(10, 60))
        resp.raise_for_status()
        resp.json()

    def via_client() -> None:
        client.generate(body["input_ids"], body["sampling_params"], new_rid("http"), "http")

    calls = bench.args.http_calls
    cpu: dict[str, list[float]] = {"requests": [], "client": []}
    for name, fn in [("requests", via_requests), ("client", via_client)] * blocks:
        fn()  # a connection of its own, opened outside the measurement
        started = time.thread_time()
        for _ in range(calls):
            fn()
        cpu[name].append(round(1000 * (time.thread_time() - started) / calls, 4))
    session.close()
    medians = {name: statistics.median(v) for name, v in cpu.items()}
    print(f"http: CPU ms per call: requests {medians['requests']:.3f}, "
          f"client {medians['client']:.3f}", flush=True)
    return {"calls_per_block": calls, "blocks": blocks, "cpu_ms_per_call": cpu,
            "median_cpu_ms_per_call": medians,
            "client_over_requests": round(medians["client"] / medians["requests"], 3)}


def bench_floor(bench: Bench, tp: dict[str, Any] | None) -> dict[str, Any]:
    """A worker with a task that does no work: Celery's own CPU per message."""
    from bench import noop_app  # noqa: PLC0415

    runs = [r for r in (tp or {}).get("runs", []) if r["mode"] == "pipeline"]
    hold_s = statistics.median(r["server"]["request_s_median"] for r in runs) if runs else 0.4
    count = bench.args.prompts
    settings = bench.settings
    bench.stop_workers()  # the no-op worker alone takes the short queue
    env = child_env(dict(bench.env, DATAGEN_BENCH_TASK_S=str(hold_s)))
    argv = worker_argv(settings, "short", hostname="noop@bench")
    argv[argv.index("workers.app")] = "bench.noop_app"
    proc = Process("noop", argv, bench.tmp / "logs" / "worker-noop.log", env)
    bench.procs.append(proc)
    app = make_app(settings)
    client = redis.Redis.from_url(bench.redis.url)
    try:
        deadline = time.monotonic() + 60
        while not app.control.ping(destination=["noop@bench"], timeout=0.5):
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the no-op worker did not start:\n{proc.log_text()[-2000:]}")
        client.delete(noop_app.COUNTER)
        jobs = [Job("floor", f"s{i:07d}", "short", "prompts/floor/run.jsonl", i * 1000,
                    500, 1024) for i in range(count)]
        before = cpu_seconds({"noop": proc.pid})
        started = time.monotonic()
        with app.producer_or_acquire() as producer:
            for job in jobs:
                enqueue(app, job, producer=producer)
        deadline = started + bench.args.run_timeout_s
        while (done := int(client.get(noop_app.COUNTER) or 0)) < count:
            if not proc.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the no-op worker ran {done} of {count} tasks:\n"
                                   f"{proc.log_text()[-2000:]}")
            time.sleep(0.05)
        wall = time.monotonic() - started
        cpu = cpu_delta(before, cpu_seconds({"noop": proc.pid}))["noop"]
    finally:
        proc.stop(timeout_s=10)
        bench.procs.remove(proc)
        app.close()
        client.close()
    floor = round(1000 * cpu / count, 3)
    direct = (tp or {}).get("direct_cpu_s_per_1000") or []
    out: dict[str, Any] = {"tasks": count, "hold_s": round(hold_s, 4), "wall_s": round(wall, 2),
                           "worker_cpu_s_per_1000": floor}
    if direct:
        out["direct_cpu_s_per_1000_median"] = statistics.median(direct)
        out["floor_over_direct"] = round(floor / max(statistics.median(direct), 1e-9), 2)
    print(f"floor: {count:,} no-op tasks held {hold_s:.3f}s each in {wall:.1f}s; "
          f"worker {floor:.2f} CPU s/1k tasks", flush=True)
    return out


def code_digests() -> dict[str, str]:
    """sha256 prefixes of the files on the measured path: the tree may hold uncommitted work."""
    import hashlib  # noqa: PLC0415

    return {name: hashlib.sha256((REPO / name).read_bytes()).hexdigest()[:12] for name in (
        "producers/producer.py", "datagen/generation/guard.py", "datagen/celery_app.py",
        "datagen/generation/job.py",
        "datagen/generation/ledger.py", "datagen/generation/runner.py", "datagen/client.py",
        "datagen/generation/records.py", "workers/generate.py", "datagen/broker.py")}


def machine(load_at_start: list[float]) -> dict[str, Any]:
    return {"cores": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "load_average_at_start": load_at_start,
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop every child
    started, load = time.monotonic(), [round(x, 2) for x in os.getloadavg()]
    code = code_digests()  # at the start: other work may change the tree during the run
    tmp = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    try:
        tokenizer = build_tiny_tokenizer(tmp / "tokenizer")
        with RedisServer(workdir=tmp / "redis") as server:
            bench = Bench(args, tmp, ChatEncoder(tokenizer), tokenizer, server)
            results = run_phases(bench, set(args.phases.split(",")))
    finally:
        if args.keep:
            print(f"scratch folder kept: {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    results.update(table=table(results), runtime_s=round(time.monotonic() - started, 1),
                   command=" ".join([".venv/bin/python bench/bench_generate.py", *sys.argv[1:]]),
                   date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), machine=machine(load),
                   code=code,
                   args=vars(args))
    print_table(results["table"])
    print(f"runtime {results['runtime_s']:.0f}s; results in {args.out}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
