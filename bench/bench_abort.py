"""What a close with ``abort_on_close`` stops on a real SGLang server.

N long requests of one dataset decode on a real SGLang 0.5.23 (``cli/sglang.py`` starts
one on this machine, or ``--server-url`` names a running one with its request log folder);
then the dataset closes, by ``datagen budget <ds> 0`` (``--close budget``: the operator's
path) or by the commit of one short response that reaches the budget (``--close commit``:
the worker's path; the short request decodes beside the N, and the budget is lowered to 1
token while it does, so its commit closes the dataset). Measured from the server's own
request log: how many of the N ran to completion anyway, how many tokens were counted
after the close, and the time from the close to the last answer (an abort, or a
completion that ran on). Requests still decoding ``--wait-s`` after the close count as
running on; the bench then stops its workers (SIGTERM: they abort their own requests by
rid), so the server is left idle.

    .venv/bin/python bench/bench_abort.py                       # starts its own server
    .venv/bin/python bench/bench_abort.py --server-url http://127.0.0.1:PORT \\
        --request-log-dir DIR --server-log FILE --model-dir DIR  # a running one
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from cli import sglang, sglang_log  # noqa: E402
from cli.stack import Process, child_env, start_worker, wait_for_workers  # noqa: E402
from config.settings import load_settings  # noqa: E402
from datagen.celery_app import make_app  # noqa: E402
from datagen.client import rid_prefix  # noqa: E402
from datagen.generation.ledger import Ledger  # noqa: E402
from datagen.redis_server import RedisServer  # noqa: E402
from producers.producer import Producer  # noqa: E402

SHORT_CAP = 128  # the closing response's cap: long enough to be decoding with the N
LONG_THRESHOLD = 60


def partition(root: Path, dataset: str, n: int) -> Path:
    rows = [{"id": f"long{i}", "prompt": " ".join(f"word{i}x{j}" for j in range(40))}
            for i in range(n)]  # over LONG_THRESHOLD tokens: the long queue
    rows.append({"id": "short", "prompt": "Say hello"})
    path = root / "partition" / f"{dataset}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path.parent


def wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise SystemExit(f"bench_abort: timed out after {timeout_s:.0f}s waiting for {what}")


class Server:
    """The real server: its URL, and where its logs are."""

    def __init__(self, url: str, request_log_dir: Path, log: Path, model_dir: Path):
        self.url, self.request_log_dir, self.log = url, request_log_dir, log
        self.model_dir = model_dir

    def served(self, dataset: str) -> dict[str, sglang_log.Served]:
        rows = sglang_log.request_rows(self.request_log_dir)
        return sglang_log.served(rows, rid_prefix(dataset))

    def decoding(self, dataset: str, rids: set[str]) -> set[str]:
        return sglang_log.decoding(self.served(dataset), rids, sglang_log.disconnected(self.log))


def run_once(server: Server, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    dataset = f"B1_abort_{uuid.uuid4().hex[:8]}"
    part = partition(work, dataset, args.requests)
    with RedisServer(workdir=work / "redis") as redis_server:
        env = {f"DATAGEN_{k.upper()}": v for k, v in {
            "redis_url": redis_server.url, "server_url": server.url, "data_dir": str(part),
            "output_dir": str(work / "out"), "tokenizer_path": str(server.model_dir),
            "sampling_params": json.dumps({"temperature": 0}),
            "short_max_tokens": str(SHORT_CAP), "long_max_tokens": str(args.cap),
            "long_threshold_tokens": str(LONG_THRESHOLD),
            "long_concurrency": str(args.requests), "short_concurrency": "1",
            "abort_on_close": "true", "read_timeout_s": "3600", "lease_s": "10",
            "budgets": json.dumps({dataset: 10**9}),
        }.items()}
        settings = load_settings(None, env=env)
        ledger = Ledger.from_settings(settings)
        queues = ("long", "short") if args.close == "commit" else ("long",)
        procs = [start_worker(q, child_env(env), work / "logs", name=f"{q}@%h") for q in queues]
        try:
            return _measure(server, dataset, settings, ledger, env, procs, work, args)
        finally:
            for proc in procs:
                proc.stop(timeout_s=60)


def _measure(server: Server, dataset: str, settings: Any, ledger: Ledger, env: dict[str, str],
             procs: list[Process], work: Path, args: argparse.Namespace) -> dict[str, Any]:
    wait_for_workers(settings.redis_url, len(procs), procs=procs)
    Producer(settings, make_app(settings), ledger).run()

    def rids(sample_start: str) -> set[str]:
        return {e["rid"] for s, e in ledger.in_flight(dataset).items()
                if s.startswith(sample_start)}
    want = args.requests + (args.close == "commit")
    wait(lambda: len(server.decoding(dataset, rids(""))) == want, 600,
         f"{want} requests decoding on the server")
    in_flight = rids("long")
    if args.close == "commit":  # the short response's commit reaches the budget
        ledger.set_budget(dataset, 1)
        if not rids("short"):
            raise SystemExit("bench_abort: the short response ended before the budget was "
                             "lowered; rerun with a larger SHORT_CAP")
    else:
        subprocess.run([sys.executable, "-m", "cli.main", "budget", dataset, "0"], cwd=REPO,
                       env=child_env(env), check=True, capture_output=True, timeout=120)
    wait(lambda: ledger.closed(dataset), 600, "the close")
    closed_at = min(e["t"] for e in ledger.events(dataset) if e["e"].startswith("closed"))
    tokens_at_close = ledger.snapshot(dataset)["tokens"]
    deadline = time.monotonic() + args.wait_s
    while server.decoding(dataset, in_flight) and time.monotonic() < deadline:
        time.sleep(0.2)
    still = server.decoding(dataset, in_flight)
    log = server.served(dataset)
    ended = [log[r] for r in in_flight if r not in still and log[r].finished is not None]
    if not still:  # whatever runs on is counted when it commits: wait for those commits
        wait(lambda: not ledger.in_flight(dataset), 120, "the last commits")
    return {
        "close": args.close, "requests": args.requests, "cap": args.cap,
        "ran_to_completion": sum(e.normal for e in ended),
        "aborted": sum(e.finish == "abort" for e in ended),
        "still_decoding_at_wait_end": len(still), "wait_s": args.wait_s,
        "tokens_counted_after_close": ledger.snapshot(dataset)["tokens"] - tokens_at_close,
        "close_to_last_answer_s": (round(max(e.finished for e in ended) - closed_at, 3)
                                   if ended and not still else None),
        "completion_tokens_at_end": sum(e.completion_tokens for e in ended),
    }


def start_server(work: Path) -> tuple[Server, Process]:
    model = sglang.build_model(work / "model")
    proc, url = sglang.start_sglang(model, work / "logs", "sglang-bench", None,
                                    work / "requests")
    (work / "requests").mkdir(parents=True, exist_ok=True)
    sglang.wait_healthy(url, proc.alive, proc.log_path)
    return Server(url, work / "requests", proc.log_path, model), proc


def render(rows: list[dict[str, Any]]) -> str:
    head = ("| close | in flight | cap | ran to completion | aborted | still decoding "
            "| tokens counted after | close → last answer |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        last = "—" if r["close_to_last_answer_s"] is None else f"{r['close_to_last_answer_s']} s"
        still = f"{r['still_decoding_at_wait_end']} (at +{r['wait_s']:.0f} s)"
        lines.append(f"| {r['close']} | {r['requests']} | {r['cap']} | {r['ran_to_completion']} "
                     f"| {r['aborted']} | {still} | {r['tokens_counted_after_close']} | {last} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8, help="requests in flight at the close")
    ap.add_argument("--cap", type=int, default=2048, help="their max_new_tokens")
    ap.add_argument("--close", default="budget,commit", help="budget, commit or both")
    ap.add_argument("--wait-s", type=float, default=120.0,
                    help="how long after the close requests may go on decoding")
    ap.add_argument("--server-url", help="a running server (else one is started here)")
    ap.add_argument("--request-log-dir", type=Path, help="its --log-requests-target folder")
    ap.add_argument("--server-log", type=Path, help="its log (disconnect aborts)")
    ap.add_argument("--model-dir", type=Path, help="the model folder it serves")
    ap.add_argument("--label", default="", help="what code ran (kept in the JSON)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "abort_real.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-abort-"))
    server_proc = None
    if args.server_url:
        server = Server(args.server_url, args.request_log_dir, args.server_log, args.model_dir)
    else:
        server, server_proc = start_server(work)
    rows = []
    try:
        for close in args.close.split(","):
            one = argparse.Namespace(**{**vars(args), "close": close})
            rows.append(run_once(server, work / close, one))
            print(render(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        if server_proc is not None:
            server_proc.stop(timeout_s=30)
    print(render(rows))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "label": args.label, "commit": commit, "host": platform.node(),
        "sglang": sglang.SGLANG_VERSION, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
