"""Peak memory of rebuild, merge and prepare, against the number of records and their size.

    .venv/bin/python bench/bench_memory.py                   # 3 cases, ~1 min on 2 cores
    .venv/bin/python bench/bench_memory.py --before 88ed949  # and the old code too, ~2 min
    .venv/bin/python bench/bench_memory.py --realistic-records 100000  # 4.5 GB disk, ~4 min
    .venv/bin/python bench/bench_memory.py --only 2000000 --small-ids 4,8  # 1 GB disk, ~9 min

Goal (issue 11 §6, issue 19 §3): at most 500 MB peak for a dataset of any size and count,
shown at 100,000 records (of 2K + 3.7K tokens) and at 2,000,000 (``--only``). Each case
writes synthetic records over 8 worker files (1% of the samples written twice, one torn
last line), rebuilds the ledger from them in one child process, merges them (with the
committed rids, as ``datagen merge`` does) in another and runs ``datagen prepare``'s
``prepare`` (merge, index, shuffle, shards; no tokenizer) in a third; each child reports its
peak RSS, and the synthetic records are deleted after. Three cases separate the two sizes:
10,000 small records (128 + 256 ids), as many realistic ones (2,048 prompt + 3,700 output ids,
as at the issue's 2K + 3.7K tokens) and 100,000 small ones; ``--only N`` runs one case of N
small records. Holding the records whole, as merge and rebuild did before issue 11, takes the
parsed size of one record (measured here) times their number; ``--before REV`` runs the three
as they were at REV too (from ``git archive``), and checks that they write the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from datagen import keys  # noqa: E402
from datagen.generation.index import encode  # noqa: E402
from datagen.generation.job import Job  # noqa: E402
from datagen.generation.records import records_dir  # noqa: E402
from datagen.redis_server import RedisServer  # noqa: E402
from datagen.tokenization.tokenizer import build_tiny_tokenizer  # noqa: E402

DATASET = "B1_mem"
WORKER_FILES = 8
DUPLICATE_EVERY = 100  # one sample in 100 written twice (a redelivery)
ID_LISTS = 16  # distinct id lists reused across records: the bytes are what matters
GOAL_MB = 500

# Run in the checkout (or, for --before, in the tree of REV: its cwd and first on sys.path).
CHILD = """
import json, os, sys, time
sys.path.insert(0, os.getcwd())
from config.settings import load_settings
from datagen.generation.ledger import Ledger
from datagen.generation.merge import merge_dataset
from datagen.generation.recovery import rebuild_dataset
try:
    from datagen.training.training_set import prepare
except ImportError:  # an older layout
    from datagen.training_set import prepare
def rss_mb(field="VmRSS:"):
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child would report
    # the bench's own size at the fork whenever that is larger
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
s = load_settings()
ledger = Ledger.from_settings(s)
base = rss_mb()
t0 = time.monotonic()
def committed(dataset):  # as `datagen merge` and `datagen prepare` read the done map
    if hasattr(ledger, "committed_index"):
        return ledger.committed_index(dataset)
    return ledger.committed(dataset) or None
if sys.argv[1] == "rebuild":
    out = rebuild_dataset(ledger, sys.argv[2])
    result = {"records": out.samples, "duplicates": out.duplicates, "problems": len(out.problems)}
elif sys.argv[1] == "merge":
    out = merge_dataset(s.output_dir, sys.argv[2], committed(sys.argv[2]))
    result = {"records": out.records, "duplicates": out.duplicates, "problems": len(out.problems)}
else:
    load = None
    if s.tokenizer_path:  # as `datagen prepare` runs: conversations decoded by the tokenizer
        from cli.extraction import decoder
        load = decoder(s)
    tset = prepare(s, {sys.argv[2]: committed(sys.argv[2])}, load)
    d = tset.datasets[0]
    conversations = None
    if tset.conversations:
        with open(tset.conversations, "rb") as fh:
            conversations = sum(1 for _ in fh)
    result = {"records": tset.samples, "duplicates": d.copies, "problems": None,
              "fingerprint": tset.fingerprint, "conversations": conversations}
result.update(seconds=time.monotonic() - t0, base_mb=base,
              peak_mb=rss_mb("VmHWM:"))
print(json.dumps(result))
"""


# What a producer re-run reads of the pending hash: every payload, or the ids alone.
PENDING_CHILD = """
import json, sys, time
from config.settings import load_settings
from datagen.generation.ledger import Ledger
ledger = Ledger.from_settings(load_settings())
t0 = time.monotonic()
read = ledger.pending if sys.argv[1] == "hgetall" else ledger.pending_ids
count = len(read(sys.argv[2]))
peak_mb = [int(x.split()[1]) / 1024 for x in open("/proc/self/status")
           if x.startswith("VmHWM:")][0]  # (not ru_maxrss: see CHILD)
print(json.dumps({"pending": count, "seconds": time.monotonic() - t0, "peak_mb": peak_mb}))
"""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=100_000, help="records of the large case")
    p.add_argument("--realistic-records", type=int, default=10_000,
                   help="records of the realistic-size case")
    p.add_argument("--small-ids", default="128,256",
                   help="prompt,output ids per record of the small cases")
    p.add_argument("--realistic-ids", default="2048,3700",
                   help="prompt,output ids per record of the realistic case")
    p.add_argument("--only", type=int, metavar="N", default=None,
                   help="one case only: N records of --small-ids (e.g. 2000000)")
    p.add_argument("--before", metavar="REV", default=None,
                   help="also run rebuild, merge and prepare as they were at this git revision "
                        "(e.g. 88ed949: an object per record; 4e45271: whole records)")
    p.add_argument("--before-max-gb", type=float, default=3.0,
                   help="--before only where holding the records whole takes at most this")
    p.add_argument("--pending", type=int, default=300_000,
                   help="pending samples for the HGETALL vs HKEYS read (0: skip it)")
    p.add_argument("--no-tokenizer", dest="tokenizer", action="store_false",
                   help="prepare without a tokenizer (no conversations; transformers and torch "
                        "are then never loaded)")
    p.add_argument("--workdir", default=None, help="where the synthetic records go (deleted)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "bench_memory.json"))
    return p.parse_args()


def id_lists(rng: random.Random, count: int) -> list[list[int]]:
    return [[rng.randrange(152_000) for _ in range(count)] for _ in range(ID_LISTS)]


def make_record(i: int, copy: int, prompts: list[list[int]], outputs: list[list[int]],
                t0: float) -> dict[str, Any]:
    """A record shaped like the runner's (``runner.persist``); ~4 bytes of text per token."""
    prompt, output = prompts[i % ID_LISTS], outputs[(i * 7 + copy) % ID_LISTS]
    return {"v": 1, "id": f"s{i:07d}", "dataset": DATASET, "rid": f"{i:08x}{copy:024x}",
            "queue": "short",
            "messages": [{"role": "user", "content": "word " * (len(prompt) * 4 // 5)}],
            "prompt_ids": prompt, "output_ids": output, "finish_reason": "stop",
            "prompt_tokens": len(prompt), "completion_tokens": len(output),
            "truncated": False, "server": "http://127.0.0.1:30000", "worker": f"w{copy}",
            "host": "bench", "time": t0 + i * 0.01 + copy, "latency_s": 12.5}


class LineMaker:
    """``encode(make_record(i, copy, ...))`` from pre-encoded pieces: the same bytes (checked
    on the first records), ~5x faster, so that 2,000,000 records take seconds to write."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], t0: float):
        self.prompts, self.outputs, self.t0 = prompts, outputs, t0
        self.enc = [encode(make_record(i, 0, prompts, outputs, t0))
                    for i in range(ID_LISTS)]  # (only to check against)
        self.head = '{"v":1,"id":"s'
        self.messages = [json.dumps([{"role": "user", "content": "word " * (len(p) * 4 // 5)}],
                                    separators=(",", ":")) for p in prompts]
        self.ids = [json.dumps(x, separators=(",", ":")) for x in prompts], [
            json.dumps(x, separators=(",", ":")) for x in outputs]

    def line(self, i: int, copy: int) -> str:
        p, o = i % ID_LISTS, (i * 7 + copy) % ID_LISTS
        return (f'{self.head}{i:07d}","dataset":"{DATASET}","rid":"{i:08x}{copy:024x}",'
                f'"queue":"short","messages":{self.messages[p]},"prompt_ids":{self.ids[0][p]},'
                f'"output_ids":{self.ids[1][o]},"finish_reason":"stop",'
                f'"prompt_tokens":{len(self.prompts[p])},'
                f'"completion_tokens":{len(self.outputs[o])},"truncated":false,'
                f'"server":"http://127.0.0.1:30000","worker":"w{copy}","host":"bench",'
                f'"time":{self.t0 + i * 0.01 + copy!r},"latency_s":12.5}}\n')

    def check(self, n: int) -> None:
        for i in range(min(n, 2000)):
            for copy in (0, 1):
                want = encode(make_record(i, copy, self.prompts, self.outputs, self.t0))
                if self.line(i, copy) != want:
                    raise SystemExit(f"LineMaker differs from encode() at record {i}")


def write_records(out: Path, n: int, prompt_ids: int, output_ids: int) -> dict[str, Any]:
    """n samples over WORKER_FILES files, 1% twice, one torn line; returns what was written."""
    rng = random.Random(n)
    prompts, outputs = id_lists(rng, prompt_ids), id_lists(rng, output_ids)
    folder = records_dir(out, DATASET)
    folder.mkdir(parents=True)
    files = [open(folder / f"bench-{w}.jsonl", "w", encoding="utf-8",  # noqa: SIM115
                  buffering=1 << 20) for w in range(WORKER_FILES)]
    t0 = time.time()
    maker = LineMaker(prompts, outputs, t0)
    maker.check(n)
    try:
        for i in range(n):
            files[i % WORKER_FILES].write(maker.line(i, 0))
            if i % DUPLICATE_EVERY == 0:  # a later copy in another worker's file
                files[(i + 1) % WORKER_FILES].write(maker.line(i, 1))
        files[-1].write(maker.line(n, 0)[:200])  # torn
    finally:
        for fh in files:
            fh.close()
    return {"records": n, "duplicates": len(range(0, n, DUPLICATE_EVERY)),
            "disk_bytes": sum(p.stat().st_size for p in folder.iterdir()),
            "parsed_bytes": parsed_size(make_record(0, 0, prompts, outputs, t0))}


def parsed_size(record: dict[str, Any]) -> int:
    """Python memory of one parsed record: what holding whole records costs each."""
    line = encode(record)
    tracemalloc.start()
    parsed = json.loads(line)
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del parsed
    return size


def before_tree(rev: str, folder: Path) -> Path:
    """The whole tree at REV (``git archive``): its children run there, imports and all."""
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def child(step: str, env: dict[str, str], code: str = CHILD,
          cwd: Path = REPO) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code, step, DATASET], cwd=cwd, env=env,
                         capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


STEPS = ("rebuild", "merge", "prepare")


def run_case(name: str, tmp: Path, n: int, ids: tuple[int, int], before: Path | None,
             before_max_bytes: float, tokenizer: Path | None) -> dict[str, Any]:
    case_dir = tmp / name
    started = time.monotonic()
    written = write_records(case_dir / "out", n, *ids)
    write_s = time.monotonic() - started
    with RedisServer(workdir=case_dir / "redis") as srv:
        env = dict(os.environ, DATAGEN_REDIS_URL=srv.url,
                   DATAGEN_OUTPUT_DIR=str(case_dir / "out"), DATAGEN_LOG_LEVEL="WARNING",
                   DATAGEN_TOKEN_BUDGET=str(10**15), DATAGEN_SHARD_SAMPLES="10000",
                   DATAGEN_TOKENIZER_PATH=str(tokenizer or ""), PYTHONPATH="")
        now = steps(env, case_dir / "out", REPO)
        old = None
        if before and n * written["parsed_bytes"] <= before_max_bytes:
            old = steps(env, case_dir / "out", before)
    shutil.rmtree(case_dir)
    for step in (now, *(old and (old,) or ())):
        for part in STEPS:
            # A wrong result would make its memory figure meaningless.
            got = step[part]
            want = (n, written["duplicates"], None if part == "prepare" else 1)
            if (got["records"], got["duplicates"], got["problems"]) != want:
                raise SystemExit(f"{name}: unexpected {part} result {got} for {written}")
    if now["prepare"]["conversations"] != (n if tokenizer else None):
        raise SystemExit(f"{name}: {now['prepare']['conversations']} conversations for {n}")
    if old and (old["sha256"], old["prepare"]["fingerprint"], old["shards_sha256"]) != (
            now["sha256"], now["prepare"]["fingerprint"], now["shards_sha256"]):
        raise SystemExit(f"{name}: the merged file or the training set differs from {before}'s")
    return {"case": name, "prompt_ids": ids[0], "output_ids": ids[1], "write_s": write_s,
            **written, **now, "before": old}


def steps(env: dict[str, str], out: Path, tree: Path) -> dict[str, Any]:
    """Rebuild, then merge with the rids it committed, then prepare, each in a child of its
    own; the ledger is emptied first, so each tree rebuilds from the records alike."""
    redis.Redis.from_url(env["DATAGEN_REDIS_URL"]).flushall()
    result: dict[str, Any] = {part: child(part, env, cwd=tree) for part in STEPS[:2]}
    merged = out / DATASET / "raw_responses.jsonl"
    result.update(merged_bytes=merged.stat().st_size, sha256=file_sha256(merged))
    result["prepare"] = child("prepare", env, cwd=tree)
    shards = hashlib.sha256()
    for path in sorted((out / "training" / "shards").glob("shard_*.jsonl")):
        shards.update(file_sha256(path).encode())
    result["shards_sha256"] = shards.hexdigest()
    return result


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def pending_reads(tmp: Path, n: int) -> dict[str, Any]:
    """Peak RSS and time of reading n pending entries (real payloads) whole, or their ids."""
    with RedisServer(workdir=tmp / "redis-pending") as srv:
        env = dict(os.environ, DATAGEN_REDIS_URL=srv.url, DATAGEN_LOG_LEVEL="WARNING")
        client = redis.Redis.from_url(srv.url)
        for start in range(0, n, 10_000):
            client.hset(keys.dataset_key(DATASET, keys.PENDING), mapping={
                f"s{i:07d}": json.dumps(Job(DATASET, f"s{i:07d}", "short",
                                            f"prompts/{DATASET}/bench-1.bin", i * 8192,
                                            2048, 8192, 0).payload())
                for i in range(start, min(n, start + 10_000))})
        used = client.info("memory")["used_memory"]
        client.close()
        return {"pending": n, "redis_bytes": used,
                "hgetall": child("hgetall", env, PENDING_CHILD),
                "hkeys": child("hkeys", env, PENDING_CHILD)}


def table(cases: list[dict[str, Any]]) -> str:
    head = ("| case | records | ids per record (prompt + output) | on disk per record | "
            "held whole (estimate) | rebuild / merge / prepare peak RSS | "
            "rebuild / merge / prepare s | before: peak RSS (s) |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for c in cases:
        whole = c["records"] * c["parsed_bytes"]
        lines.append(
            f"| {c['case']} | {c['records']:,} | {c['prompt_ids']:,} + {c['output_ids']:,} | "
            f"{c['disk_bytes'] / c['records'] / 1e3:.1f} KB | {_size(whole)} "
            f"({c['parsed_bytes'] / 1e3:.0f} KB each) | {_peaks(c)} | "
            f"{_seconds(c)} | {_before(c['before'])} |")
    return "\n".join(lines)


def _peaks(c: dict[str, Any]) -> str:
    return " / ".join(f"{c[s]['peak_mb']:,.0f}" for s in STEPS) + " MB"


def _seconds(c: dict[str, Any]) -> str:
    return " / ".join(f"{c[s]['seconds']:.1f}" for s in STEPS)


def _before(old: dict[str, Any] | None) -> str:
    return f"{_peaks(old)} ({_seconds(old)} s)" if old else "not run"


def _size(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.1f} GB" if n_bytes >= 1e9 else f"{n_bytes / 1e6:.0f} MB"


def main() -> int:
    started = time.monotonic()
    args = parse_args()
    small = tuple(int(x) for x in args.small_ids.split(","))
    realistic = tuple(int(x) for x in args.realistic_ids.split(","))
    few = max(1, args.records // 10)
    plan = [("small records", few, small),
            ("realistic records", args.realistic_records, realistic),
            ("small records, 10x as many", args.records, small)]
    if args.only:
        plan = [("small records", args.only, small)]
    with tempfile.TemporaryDirectory(prefix="bench-memory-", dir=args.workdir) as name:
        tmp = Path(name)
        before = before_tree(args.before, tmp / "before") if args.before else None
        tokenizer = None
        if args.tokenizer:
            tokenizer = build_tiny_tokenizer(tmp / "tokenizer")
        cases = [run_case(label, tmp, n, ids, before, args.before_max_gb * 1e9, tokenizer)
                 for label, n, ids in plan]
        pending = pending_reads(tmp, args.pending) if args.pending else None
    print(table(cases))
    print(f"\nwall time {time.monotonic() - started:.0f} s")
    base = max(c[s]["base_mb"] for c in cases for s in STEPS)
    peak = max(c[s]["peak_mb"] for c in cases for s in STEPS)
    verdict = "met" if peak <= GOAL_MB else "MISSED"
    print(f"\nchild RSS before the work (Python, redis, datagen imports): {base:.0f} MB; "
          f"highest peak {peak:.0f} MB; goal <= {GOAL_MB} MB: {verdict}")
    if pending:
        print(f"\nproducer re-run, {pending['pending']:,} pending: "
              + "; ".join(f"{how} {pending[how]['peak_mb']:.0f} MB peak RSS, "
                          f"{pending[how]['seconds']:.2f} s" for how in ("hgetall", "hkeys")))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
        "goal_mb": GOAL_MB, "wall_s": time.monotonic() - started, "cases": cases,
        "pending_read": pending}, indent=2))
    return 0 if peak <= GOAL_MB else 1


if __name__ == "__main__":
    sys.exit(main())
