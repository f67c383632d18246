"""What the ledger costs Redis: server time per admit and commit, and traffic per sample.

Part 1, server time (Redis INFO commandstats, usec per EVALSHA), at 0 / 100 / 1,000 /
10,000 requests in flight, today's scripts beside the scripts of ``--old REV`` (the
ledger before v2: admission decoded every in-flight entry), on one throwaway Redis, in
one run. The in-flight state is written directly: starts spread over the last
``--spread-s`` seconds, caps 10,240 (90%) and 16,384 (10%), and a length model learnt
from 4,096 lognormal lengths (mean 3.7K, sigma 1), as a long run holds it.
Then one cap (10,240) against every cap distinct (240-10,240: long prompts each get
context - prompt - 1), filled three ways: admitted through ``Ledger.admit`` now (what a burst
of admissions leaves); starts spread over each request's own expected duration (cap / 40
tok/s, at most ``--spread-s``: what a long run holds); and starts spread over ``--spread-s``
whatever the cap (the most buckets: short requests as old as long ones). Each row: admit
admitted, admit refused (the sample is parked), and commit while samples are parked (it
computes how many fit). ``--before REV`` runs REV's scripts beside this tree's on the fill
both can write (through Ledger.admit), alternating on one Redis.

Part 2, traffic per generated sample: the generation steps (admit, call, persist, commit,
and the heartbeat's lease renewal) run in threads of this process against the simulator
over HTTP, with a Redis client that counts what it sends: commands (a script call is one)
and round trips (a pipeline is one). Celery's own traffic (kombu's BRPOP and acks, task
events) is not in it; ``--system`` adds a run through a real Celery worker and reports
Redis's own count of client reads per sample (every client: producer, kombu, events,
ledger).

Part "model" (``--parts model``), a worker's CPU per refresh of the length model (what
``Ledger.refresh_model`` computes four times a second: ``length_model`` and ``encode_model``)
at LENGTHS_KEPT lengths and 180 requests in flight, this tree's admission.py beside
``--before REV``'s in alternating blocks; both must give the same bytes.

    .venv/bin/python bench/bench_ledger.py              # ~1 min
    .venv/bin/python bench/bench_ledger.py --system     # + the whole-system figure
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median
from typing import Any, NamedTuple

import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cli.stack import child_env, start_simulator, start_worker, wait_for_workers  # noqa: E402
from config.settings import Settings, load_settings  # noqa: E402
from datagen import keys  # noqa: E402
from datagen.celery_app import make_app  # noqa: E402
from datagen.client import SGLangClient  # noqa: E402
from datagen.generation.admission import (  # noqa: E402
    BUCKET_COUNT,
    bucket_field,
    encode_model,
    length_model,
)
from datagen.generation.job import Job, PromptStore  # noqa: E402
from datagen.generation.lease import LeaseBook  # noqa: E402
from datagen.generation.ledger import Ledger, connect, owner_id  # noqa: E402
from datagen.generation.records import RecordWriter  # noqa: E402
from datagen.generation.runner import Context, run_job  # noqa: E402
from datagen.redis_server import RedisServer, redis_binary, redis_version  # noqa: E402
from datagen.tokenization.chat import ChatEncoder  # noqa: E402
from datagen.tokenization.tokenizer import build_tiny_tokenizer  # noqa: E402
from producers.producer import Producer  # noqa: E402

DS = "B1_bench"
CAPS = (10240,) * 9 + (16384,)
RATE = 40.0  # tokens per second of one request, as the model says


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--in-flight", default="0,100,1000,10000")
    p.add_argument("--calls", type=int, default=300, help="admits and commits measured")
    p.add_argument("--spread-s", type=float, default=240.0)
    p.add_argument("--old", default="33cb648", help="git revision of the old ledger ('' off)")
    p.add_argument("--before", default="",
                   help="git revision whose scripts to measure beside this tree's, on the "
                        "one-cap and distinct-caps cases (main, say; '' off)")
    p.add_argument("--samples", type=int, default=600, help="part 2: samples generated")
    p.add_argument("--threads", type=int, default=48)
    p.add_argument("--system", action="store_true", help="part 2 through a Celery worker too")
    p.add_argument("--rounds", type=int, default=1,
                   help="times the cap cases run (alternating with --before's)")
    p.add_argument("--parts", default="server,caps,traffic",
                   help="comma list of server (per-call cost against --old), caps (one cap "
                        "against distinct caps, against --before), traffic (per sample), "
                        "model (CPU per length-model refresh, against --before)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "bench_ledger.json"))
    return p.parse_args()


# -- part 1: server time per call -----------------------------------------------------


def lognormal(n: int, seed: int = 3) -> list[int]:
    rng = random.Random(seed)
    mu = math.log(3700) - 0.5
    return [min(10240, max(1, int(rng.lognormvariate(mu, 1.0)))) for _ in range(n)]


def usec_per_call(r: redis.Redis) -> float:
    stats = r.info("commandstats").get("cmdstat_evalsha", {})
    return float(stats.get("usec_per_call", 0.0))


def two_caps(i: int, n: int) -> int:
    return CAPS[i % len(CAPS)]


def distinct_caps(i: int, n: int) -> int:
    return 240 + i * 10000 // max(1, n)


class Layout(NamedTuple):
    """How a tree's scripts keep the buckets and read the model (its admission.py), to
    write state directly."""

    bucket_field: Any
    bucket_count: int
    encode_model: Any  # model -> what the ledger SETs


THIS_LAYOUT = Layout(bucket_field, BUCKET_COUNT, encode_model)


def admission_at(rev: str) -> dict[str, Any]:
    """REV's admission.py, loaded from git: its module namespace."""
    source = subprocess.run(["git", "show", f"{rev}:datagen/generation/admission.py"],
                            cwd=REPO, capture_output=True, text=True, check=True).stdout
    space: dict[str, Any] = {"__name__": f"admission_at_{rev}"}
    exec(compile(source, f"{rev}:datagen/generation/admission.py", "exec"), space)  # noqa: S102
    return space


def layout_of(rev: str) -> Layout:
    """REV's bucket_field, BUCKET_COUNT and the model's encoding (JSON of ``stored`` before
    ``encode_model``)."""
    space = admission_at(rev)
    encode = space.get("encode_model") or (lambda m: json.dumps(space["stored"](m)))
    return Layout(space["bucket_field"], space["BUCKET_COUNT"], encode)


class BeforeLedger(Ledger):
    """This tree's ledger with --before's scripts: it writes the model as they read it."""

    encode_model: Any = staticmethod(encode_model)

    def refresh_model(self, dataset: str) -> dict[str, Any] | None:
        model = super().refresh_model(dataset)
        if model is not None:
            self.r.set(self.k(dataset, keys.MODEL), self.encode_model(model))
        return model


def new_state(r: redis.Redis, ledger: Ledger, n: int, spread_s: float, cap_of: Any = two_caps,
              own_duration: bool = False, layout: Layout = THIS_LAYOUT) -> None:
    """n in-flight entries the way admit.lua writes them, starts spread over spread_s (or
    over each one's expected duration, cap / RATE, when that is shorter and own_duration)."""
    sec, usec = r.time()
    now = sec + usec / 1e6
    rng = random.Random(n)
    k = ledger.k
    caps = [cap_of(i, n) for i in range(n)]
    cap_max = max(caps, default=1)
    r.hset(k(DS, keys.STATS), "cap", cap_max)
    with r.pipeline(transaction=False) as pipe:
        for i, cap in enumerate(caps):
            age = min(spread_s, cap / RATE) if own_duration else spread_s
            start = now - rng.uniform(0, age)
            bucket = layout.bucket_field(start, cap, cap_max, RATE)
            pipe.hset(k(DS, keys.INFLIGHT), f"f{i}", json.dumps(
                {"rid": f"rf{i}", "worker": "w", "server": "s", "start": start,
                 "max_new_tokens": cap, "prompt_tokens": 900, "b": bucket}))
            pipe.hincrby(k(DS, keys.BUCKETS), bucket, cap * layout.bucket_count + 1)
            pipe.hincrby(k(DS, keys.BUCKETS), "_prompt", 900)
            pipe.zadd(k(DS, keys.LEASES), {f"f{i}": now + 600})
        pipe.execute()


def admitted_state(ledger: Ledger, n: int, cap_of: Any) -> None:
    """n requests admitted through Ledger.admit, one after the other (the issue's fill)."""
    for i in range(n):
        status = ledger.admit(DS, f"f{i}", f"rf{i}", "w", 900, cap_of(i, n)).status
        assert status == "ok", status


def old_state(r: redis.Redis, ledger: Ledger, n: int, spread_s: float) -> None:
    """The same requests in the old layout: one JSON entry per request, host time."""
    now = time.time()
    rng = random.Random(n)
    with r.pipeline(transaction=False) as pipe:
        for i in range(n):
            pipe.hset(ledger.k(DS, keys.INFLIGHT), f"f{i}", json.dumps(
                {"rid": f"rf{i}", "worker": "w", "start": now - rng.uniform(0, spread_s),
                 "server": "s", "prompt_tokens": 900, "max_new_tokens": CAPS[i % len(CAPS)]}))
        pipe.execute()


def install_model(r: redis.Redis, ledger: Ledger) -> None:
    model = length_model(lognormal(4096), RATE * 1000, 1000.0, [3000.0] * 150, 16384)
    r.set(ledger.k(DS, keys.MODEL), encode_model(model))
    r.hset(keys.BUDGETS, DS, 10**12)


def measure_new(r: redis.Redis, ledger: Ledger, n: int, args: argparse.Namespace
                ) -> tuple[float, float]:
    new_state(r, ledger, n, args.spread_s)
    install_model(r, ledger)
    r.config_resetstat()
    for i in range(args.calls):
        status = ledger.admit(DS, f"a{i}", f"ra{i}", "w", 900, 10240).status
        assert status == "ok", status
    admit_us = usec_per_call(r)
    r.config_resetstat()
    for i in range(args.calls):
        ledger.commit(DS, f"a{i}", f"ra{i}", 900, 3700, False, 90.0)
    return admit_us, usec_per_call(r)


FILLS = ("admitted now", "own duration", "whole spread")


def one_cap(i: int, n: int) -> int:
    return 10240


def measure_caps(r: redis.Redis, ledger: Ledger, n: int, caps: str, fill: str,
                 model: dict[str, Any], args: argparse.Namespace,
                 layout: Layout = THIS_LAYOUT) -> dict[str, Any]:
    """Admit admitted, admit refused (the sample is parked), commit while samples are parked
    (it computes how many fit, and finds none)."""
    cap_of = distinct_caps if caps == "distinct" else one_cap
    r.set(ledger.k(DS, keys.MODEL), layout.encode_model(model))
    r.hset(keys.BUDGETS, DS, 10**12)
    if fill == "admitted now":
        admitted_state(ledger, n, cap_of)
    else:
        new_state(r, ledger, n, args.spread_s, cap_of, fill == "own duration", layout)
    fields = r.hlen(ledger.k(DS, keys.BUCKETS)) - 1  # less "_prompt"
    r.config_resetstat()
    for i in range(args.calls):
        status = ledger.admit(DS, f"a{i}", f"ra{i}", "w", 900, cap_of(5000 + i, 10**4)).status
        assert status == "ok", status
    admit_us = usec_per_call(r)
    # A budget half spent by what is in flight: admission refuses, commits wake nobody.
    expected = ledger.admit(DS, "probe", "rp", "w", 900, 5000).expected_in_flight
    ledger.release(DS, "probe", "rp")
    r.hset(keys.BUDGETS, DS, expected // 2)
    r.config_resetstat()
    for i in range(args.calls):
        status = ledger.admit(DS, f"z{i}", f"rz{i}", "w", 900, cap_of(7000 + i, 10**4)).status
        assert status == "wait", status
    refused_us = usec_per_call(r)
    r.config_resetstat()
    for i in range(args.calls):
        assert ledger.commit(DS, f"a{i}", f"ra{i}", 900, 1, False, 90.0).woken == []
    return {"in_flight": n, "caps": caps, "fill": fill, "fields": fields,
            "admit_us": admit_us, "refused_us": refused_us,
            "parked_commit_us": usec_per_call(r)}


def scripts_of(r: redis.Redis, rev: str) -> dict[str, Any]:
    """The ledger's scripts as they are at git revision rev (for --before)."""
    def show(name: str) -> str | None:
        out = subprocess.run(["git", "show", f"{rev}:datagen/generation/lua/{name}"], cwd=REPO,
                             capture_output=True, text=True)
        return out.stdout if out.returncode == 0 else None  # None: not there at rev
    lib = show("_lib.lua")
    return {name: r.register_script(f"{lib}\n{text}") for name in Ledger.SCRIPTS
            if (text := show(f"{name}.lua")) is not None}


def measure_old(r: redis.Redis, ledger: Ledger, scripts: dict[str, Any], n: int,
                args: argparse.Namespace) -> tuple[float, float]:
    old_state(r, ledger, n, args.spread_s)
    install_model(r, ledger)
    k = ledger.k
    admit_keys = [k(DS, keys.CLOSED), k(DS, keys.DONE), k(DS, keys.INFLIGHT), k(DS, keys.STATS),
                  keys.BUDGETS, k(DS, keys.MODEL)]
    commit_keys = [k(DS, p) for p in (keys.DONE, keys.STATS, keys.INFLIGHT, keys.PENDING,
                                      keys.LENGTHS, keys.CLOSED)] + [
        keys.BUDGETS, k(DS, keys.SPEEDS), k(DS, keys.PROGRESS)]
    r.config_resetstat()
    for i in range(args.calls):
        entry = json.dumps({"rid": f"ra{i}", "worker": "w", "start": time.time(), "server": "s",
                            "prompt_tokens": 900, "max_new_tokens": 10240})
        status = scripts["admit"](keys=admit_keys, args=[
            DS, f"a{i}", entry, time.time(), 10**12, 900, "completion", 1, 2048, 1.0])[0]
        assert status == b"ok", status
    admit_us = usec_per_call(r)
    r.config_resetstat()
    for i in range(args.calls):
        scripts["commit"](keys=commit_keys, args=[
            DS, f"a{i}", f"ra{i}", 3700, 900, 3700, 0, 10**12, 0, 4096, 90.0, time.time()])
    return admit_us, usec_per_call(r)


def old_scripts(r: redis.Redis, rev: str) -> dict[str, Any] | None:
    if not rev:
        return None
    out = {}
    for name in ("admit", "commit"):
        text = subprocess.run(["git", "show", f"{rev}:datagen/lua/{name}.lua"], cwd=REPO,
                              capture_output=True, text=True)
        if text.returncode:
            print(f"old scripts of {rev} not found: {text.stderr.strip()}", file=sys.stderr)
            return None
        out[name] = r.register_script(text.stdout)
    return out


def part1(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    rows = []
    with RedisServer(workdir=tmp / "redis1") as srv:
        r = redis.Redis.from_url(srv.url)
        ledger = Ledger(connect(srv.url), Settings(redis_url=srv.url))
        old = old_scripts(r, args.old)
        for n in (int(x) for x in args.in_flight.split(",")):
            r.flushall()
            ledger.mark_run()
            admit_us, commit_us = measure_new(r, ledger, n, args)
            buckets = r.hlen(ledger.k(DS, keys.BUCKETS)) - 1
            row = {"in_flight": n, "buckets": buckets, "admit_us": admit_us,
                   "commit_us": commit_us}
            if old is not None:
                r.flushall()
                row["old_admit_us"], row["old_commit_us"] = measure_old(r, ledger, old, n, args)
            rows.append(row)
            print(row, flush=True)
    return rows


def part1_caps(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """One cap against every cap distinct, this tree's scripts, then --before's (its scripts
    and its bucket layout) on the same fill, alternating, on one Redis, --rounds times."""
    rows = []
    model = length_model(lognormal(4096), RATE * 1000, 1000.0, [3000.0] * 150, 16384)
    with RedisServer(workdir=tmp / "redis1c") as srv:
        r = redis.Redis.from_url(srv.url)
        ledger = Ledger(connect(srv.url), Settings(redis_url=srv.url))
        runs = [("this tree", ledger, THIS_LAYOUT)]
        if args.before:
            layout = layout_of(args.before)
            before = BeforeLedger(connect(srv.url), Settings(redis_url=srv.url))
            before._scripts = scripts_of(before.r, args.before)
            before.encode_model = layout.encode_model
            runs.append((f"before ({args.before})", before, layout))
        cases = [(n, caps, fill) for n in (int(x) for x in args.in_flight.split(",")) if n
                 for caps in ("one cap", "distinct") for fill in FILLS]
        for round_ in range(args.rounds):
            for n, caps, fill in cases:
                for code, led, layout in runs:
                    r.flushall()
                    led.mark_run()
                    rows.append({"code": code, "round": round_,
                                 **measure_caps(r, led, n, caps, fill, model, args, layout)})
                    print(rows[-1], flush=True)
    return rows


# -- part 2: traffic per generated sample ----------------------------------------------


class Counter:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.commands = 0
        self.round_trips = 0

    def add(self, commands: int = 0, round_trips: int = 0) -> None:
        with self.lock:
            self.commands += commands
            self.round_trips += round_trips


COUNT = Counter()


class CountingConnection(redis.Connection):
    """Counts what is sent: one command, or a pipeline's commands, per round trip."""

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        COUNT.add(commands=1)
        super().send_command(*args, **kwargs)

    def pack_commands(self, commands: Any) -> Any:
        commands = list(commands)
        COUNT.add(commands=len(commands))
        return super().pack_commands(commands)

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        COUNT.add(round_trips=1)
        super().send_packed_command(command, check_health)


def counting_client(url: str) -> redis.Redis:
    pool = redis.ConnectionPool.from_url(url, decode_responses=True,
                                         connection_class=CountingConnection)
    return redis.Redis(connection_pool=pool)


def make_jobs(settings: Settings, encoder: ChatEncoder, n: int) -> list[Job]:
    store = PromptStore(settings.output_dir, DS)
    jobs = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Explain topic {i} in depth."}]
        ids = encoder.encode(messages)
        offset = store.add(f"q{i:05d}", DS, messages, ids)
        jobs.append(Job(DS, f"q{i:05d}", "short", store.relative, offset, len(ids), 512))
    store.close()
    return jobs


def part2(args: argparse.Namespace, tmp: Path, tokenizer: Path, encoder: ChatEncoder
          ) -> dict[str, Any]:
    logs = tmp / "logs"
    with RedisServer(workdir=tmp / "redis2") as srv:
        sim, url = start_simulator(logs, [
            "--max-running-requests", str(args.threads * 2), "--lengths", "uniform:100:400",
            "--decode-step-s", "0.002", "--vocab-size", str(encoder.vocab_size),
            "--eos-token-id", str(encoder.eos_token_id)], name="sim-part2")
        try:
            settings = Settings(redis_url=srv.url, server_url=url, output_dir=str(tmp / "out2"),
                                tokenizer_path=str(tokenizer), token_budget=10**12,
                                lease_s=3.0)
            plain = Ledger.from_settings(settings)
            plain.register([DS])
            plain.mark_run()
            jobs = make_jobs(settings, encoder, args.samples)
            plain.add_pending(DS, {j.sample: json.dumps(j.payload()) for j in jobs})
            ledger = Ledger(counting_client(srv.url), settings)
            owner = owner_id("bench", os.getpid())
            ctx = Context(settings, ledger, SGLangClient(url), RecordWriter(settings.output_dir,
                          owner), owner, LeaseBook(ledger, owner))
            stop = threading.Event()

            def heartbeat() -> None:  # what liveness.Heartbeat does every lease/3
                while not stop.wait(settings.lease_s / 3):
                    ctx.leases.renew()
            beat = threading.Thread(target=heartbeat, daemon=True)
            r = redis.Redis.from_url(srv.url)
            before = r.info("stats")
            COUNT.commands = COUNT.round_trips = 0
            started = time.monotonic()
            beat.start()
            with ThreadPoolExecutor(args.threads) as pool:
                outcomes = list(pool.map(lambda j: run_job(ctx, j).status, jobs))
            stop.set()
            seconds = time.monotonic() - started
            after = r.info("stats")
            stored = outcomes.count("stored")
            assert stored == args.samples, {s: outcomes.count(s) for s in set(outcomes)}
            return {"samples": stored, "seconds": seconds,
                    "commands_per_sample": COUNT.commands / stored,
                    "round_trips_per_sample": COUNT.round_trips / stored,
                    "server_commands_per_sample_incl_lua": (
                        after["total_commands_processed"]
                        - before["total_commands_processed"]) / stored}
        finally:
            sim.stop()


def system(args: argparse.Namespace, tmp: Path, tokenizer: Path, encoder: ChatEncoder
           ) -> dict[str, Any]:
    """The whole system through a real Celery worker: Redis's own count of client reads."""
    logs = tmp / "logs"
    part = tmp / "partition3" / DS
    part.mkdir(parents=True)
    with open(part / "p.jsonl", "w") as fh:
        for i in range(args.samples):
            fh.write(json.dumps({"id": f"q{i:05d}", "prompt": f"Explain topic {i}."}) + "\n")
    with RedisServer(workdir=tmp / "redis3") as srv:
        sim, url = start_simulator(logs, [
            "--max-running-requests", str(args.threads * 2), "--lengths", "uniform:100:400",
            "--decode-step-s", "0.002", "--vocab-size", str(encoder.vocab_size),
            "--eos-token-id", str(encoder.eos_token_id)], name="sim-system")
        env = {"DATAGEN_REDIS_URL": srv.url, "DATAGEN_SERVER_URL": url,
               "DATAGEN_OUTPUT_DIR": str(tmp / "out3"), "DATAGEN_TOKENIZER_PATH": str(tokenizer),
               "DATAGEN_DATA_DIR": str(part.parent), "DATAGEN_SHORT_CONCURRENCY":
               str(args.threads), "DATAGEN_SHORT_MAX_TOKENS": "512"}
        worker = start_worker("short", child_env(env), logs, name="bench-system@%h")
        try:
            wait_for_workers(srv.url, 1, procs=[worker])
            settings = load_settings(None, env=env)
            ledger = Ledger.from_settings(settings)
            r = redis.Redis.from_url(srv.url)
            before = r.info("stats")
            started = time.monotonic()
            Producer(settings, make_app(settings), ledger).run()
            while ledger.snapshot(DS)["stats"].get("samples", 0) < args.samples:
                time.sleep(0.2)
            seconds = time.monotonic() - started
            after = r.info("stats")
            n = args.samples
            return {"samples": n, "seconds": seconds,
                    "client_reads_per_sample": (after["total_reads_processed"]
                                                - before["total_reads_processed"]) / n,
                    "commands_per_sample_incl_lua": (after["total_commands_processed"]
                                                     - before["total_commands_processed"]) / n}
        finally:
            worker.stop()
            sim.stop()


# -- part "model": CPU per length-model refresh --------------------------------------------


def part_model(args: argparse.Namespace, blocks: int = 6, per_block: int = 10
               ) -> dict[str, Any]:
    """ms of CPU (this thread's) per length_model + encode_model, median of alternating
    blocks, this tree against --before's admission.py; their models' bytes compared."""
    lengths = lognormal(keys.LENGTHS_KEPT)
    rng = random.Random(5)
    censored = [rng.uniform(0, 3000) for _ in range(180)]
    trees = {"this": {"length_model": length_model, "encode_model": encode_model}}
    if args.before:
        trees[args.before] = admission_at(args.before)
    packed = {name: t["encode_model"](t["length_model"](lengths, RATE, 1.0, censored, 10240))
              for name, t in trees.items()}
    ms: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(blocks):
        for name, t in trees.items():
            started = time.thread_time()
            for _ in range(per_block):
                t["encode_model"](t["length_model"](lengths, RATE, 1.0, censored, 10240))
            ms[name].append(1000 * (time.thread_time() - started) / per_block)
    return {"lengths": len(lengths), "censored": len(censored),
            "same_bytes": len(set(packed.values())) == 1,
            "ms_per_refresh": {name: round(median(v), 2) for name, v in ms.items()},
            "blocks": {name: [round(x, 2) for x in v] for name, v in ms.items()}}


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as name:
        tmp = Path(name)
        tokenizer = build_tiny_tokenizer(tmp / "tok")
        encoder = ChatEncoder(tokenizer)
        parts = set(args.parts.split(","))
        rows = part1(args, tmp) if "server" in parts else []
        distinct = part1_caps(args, tmp) if "caps" in parts else []
        traffic = part2(args, tmp, tokenizer, encoder) if "traffic" in parts else None
        whole = system(args, tmp, tokenizer, encoder) if args.system else None
        model = part_model(args) if "model" in parts else None
    print_tables(rows, distinct, traffic, whole)
    if model:
        print(f"\nlength-model refresh at {model['lengths']:,} lengths, {model['censored']} in "
              f"flight, ms of CPU (median): {model['ms_per_refresh']}; same bytes: "
              f"{model['same_bytes']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(),
                    "redis": f"{redis_binary()} {redis_version(redis_binary())}"},
        "args": vars(args), "server_time": rows, "distinct_caps": distinct, "traffic": traffic,
        "system": whole, "model": model},
        indent=2))
    return 0


def print_tables(rows: list[dict[str, Any]], distinct: list[dict[str, Any]],
                 traffic: dict[str, Any], whole: dict[str, Any] | None) -> None:
    print("\n| in flight | buckets | admit µs | commit µs | old admit µs | old commit µs |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['in_flight']:,} | {r['buckets']} | {r['admit_us']:.0f} | "
              f"{r['commit_us']:.0f} | {r.get('old_admit_us', float('nan')):.0f} | "
              f"{r.get('old_commit_us', float('nan')):.0f} |")
    if distinct:
        print_caps(distinct)
    if traffic is None:
        return
    print(f"\nper generated sample (datagen's own traffic, {traffic['samples']} samples): "
          f"{traffic['commands_per_sample']:.2f} commands in "
          f"{traffic['round_trips_per_sample']:.2f} round trips "
          f"({traffic['server_commands_per_sample_incl_lua']:.1f} commands counting those "
          "run inside scripts)")
    if whole:
        print(f"whole system through Celery ({whole['samples']} samples): "
              f"{whole['client_reads_per_sample']:.1f} client reads per sample, "
              f"{whole['commands_per_sample_incl_lua']:.1f} commands incl. script internals")


def print_caps(distinct: list[dict[str, Any]]) -> None:
    """One row per (scripts, in flight, caps, fill): the median over the rounds, and the
    range when there was more than one."""
    print("\none cap against every cap distinct (median of the rounds, range):\n| scripts | "
          "in flight | caps | starts | bucket fields | admit µs | admit refused µs | "
          "commit with parked µs |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    cases: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in distinct:
        cases.setdefault((r["in_flight"], r["caps"], r["fill"], r["code"]), []).append(r)

    def cell(runs: list[dict[str, Any]], name: str) -> str:
        values = [r[name] for r in runs]
        spread = f" ({min(values):.0f}-{max(values):.0f})" if len(values) > 1 else ""
        return f"{median(values):.0f}{spread}"

    for (n, caps, fill, code), runs in cases.items():
        print(f"| {code} | {n:,} | {caps} | {fill} | {runs[0]['fields']} | "
              f"{cell(runs, 'admit_us')} | {cell(runs, 'refused_us')} | "
              f"{cell(runs, 'parked_commit_us')} |")


if __name__ == "__main__":
    sys.exit(main())
