"""Throughput with latency on every worker link against none, side by side, across hosts.

Hosts are network namespaces (tests/net/lab.py; root only): Redis, the server (the
simulator), two worker hosts and a control host running `datagen produce`. With latency,
each worker host reaches Redis and the server through a relay on its own loopback that
delays every byte by DELAY ms each way (tests/net/relay.py: this kernel has no netem).
Rounds alternate 0 ms and DELAY ms, for long (~3 s) and short (~50 ms) requests; throughput
is samples over the time from the first request's start to the last one's end on the server.

    .venv/bin/python bench/bench_net_latency.py            # ~5 min; results in bench/results/
"""

from __future__ import annotations

import argparse
import json
import statistics
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

from cli.stack import child_env  # noqa: E402
from datagen import keys  # noqa: E402
from datagen.tokenization.chat import ChatEncoder  # noqa: E402
from datagen.tokenization.tokenizer import build_tiny_tokenizer  # noqa: E402

WORKLOADS = {"long (~3 s)": ("fixed:150", "0.02", 64), "short (~50 ms)": ("fixed:5", "0.01", 480)}
REDIS_PORT, SERVER_PORT, RELAY_REDIS, RELAY_SERVER = 6379, 30000, 16379, 30001


def round_once(lab: Lab, work: Path, tok: Path, enc: ChatEncoder, sock: Path, delay_ms: float,
               lengths: str, step: str, samples: int, name: str) -> dict[str, Any]:
    client = redis.Redis(unix_socket_path=str(sock))
    client.flushall()
    log = work / f"{name}.requests.jsonl"
    sim = lab.spawn("server", f"sim-{name}", [
        sys.executable, "-u", "-m", "simulator", "--host", lab.hosts["server"].ip, "--port",
        str(SERVER_PORT), "--vocab-size", str(enc.vocab_size), "--eos-token-id",
        str(enc.eos_token_id), "--lengths", lengths, "--decode-step-s", step,
        "--max-running-requests", "64", "--request-log", str(log)])
    lab.wait_log(sim, "SIMULATOR_READY")
    part = work / f"part-{name}"
    part.mkdir()
    (part / "B1.jsonl").write_text("".join(
        json.dumps({"id": f"B1-{i:04d}", "prompt": f"question {i}"}) + "\n"
        for i in range(samples)))
    base = {"DATAGEN_OUTPUT_DIR": str(work / f"out-{name}"), "DATAGEN_DATA_DIR": str(part),
            "DATAGEN_TOKENIZER_PATH": str(tok), "DATAGEN_SHORT_CONCURRENCY": "8",
            "DATAGEN_SHORT_MAX_TOKENS": "400", "DATAGEN_LEASE_S": "30"}
    direct = {"DATAGEN_REDIS_URL": f"redis://{lab.hosts['redis'].ip}:{REDIS_PORT}/0",
              "DATAGEN_SERVER_URL": f"http://{lab.hosts['server'].ip}:{SERVER_PORT}"}
    procs = [sim]
    for host in ("w1", "w2"):
        env = dict(base, **direct)
        if delay_ms:
            for port, to in ((RELAY_REDIS, f"{lab.hosts['redis'].ip}:{REDIS_PORT}"),
                             (RELAY_SERVER, f"{lab.hosts['server'].ip}:{SERVER_PORT}")):
                relay = lab.spawn(host, f"relay-{host}-{port}-{name}", [
                    sys.executable, "-u", str(REPO / "tests" / "net" / "relay.py"), "--listen",
                    f"127.0.0.1:{port}", "--to", to, "--delay-ms", str(delay_ms)])
                lab.wait_log(relay, "RELAY_READY")
                procs.append(relay)
            env.update(DATAGEN_REDIS_URL=f"redis://127.0.0.1:{RELAY_REDIS}/0",
                       DATAGEN_SERVER_URL=f"http://127.0.0.1:{RELAY_SERVER}")
        worker = lab.spawn(host, f"worker-{host}-{name}", [
            sys.executable, "-m", "cli.main", "worker", "short", "-n", f"{host}-{name}@%h"],
            child_env(env))
        lab.wait_log(worker, " ready.")
        procs.append(worker)
    produce = lab.spawn("control", f"produce-{name}", [
        sys.executable, "-m", "cli.main", "produce"], child_env(dict(base, **direct)))
    procs.append(produce)
    while _done(client) < samples:
        if not all(p.alive() for p in procs if p is not produce):
            raise RuntimeError(f"a process of round {name} exited; logs in {work / 'logs'}")
        time.sleep(0.2)
    events = [json.loads(x) for x in log.read_text().splitlines()]
    starts = [e["time"] for e in events if e["event"] == "start"]
    ends = [e["time"] for e in events if e["event"] == "finish"]
    for proc in reversed(procs):
        proc.stop(timeout_s=10)
        lab.procs.remove(proc)
    seconds = max(ends) - min(starts)
    return {"delay_ms": delay_ms, "samples": samples, "requests": len(starts),
            "seconds": round(seconds, 2), "samples_per_s": round(samples / seconds, 2)}


def _done(client: redis.Redis) -> int:
    return int(client.hget(keys.dataset_key("B1", keys.STATS), "samples") or 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay (ms)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each setting")
    parser.add_argument("--quick", action="store_true", help="a quarter of the samples (tests)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "net_latency.json"))
    args = parser.parse_args()
    if reason := unavailable_reason():
        print(f"cannot make hosts here: {reason}")
        return 2
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-net-") as tmp:
        work = Path(tmp)
        tok = build_tiny_tokenizer(work / "tok")
        enc = ChatEncoder(tok)
        with Lab(work) as lab:
            for host in ("redis", "server", "w1", "w2", "control"):
                lab.host(host)
            sock = lab.start_redis("redis", REDIS_PORT)
            while not sock.exists():
                time.sleep(0.05)
            for label, (lengths, step, samples) in WORKLOADS.items():
                samples = samples // 4 if args.quick else samples
                for r in range(args.rounds):
                    for delay in (0.0, args.delay_ms):  # side by side: alternate
                        name = f"{label.split()[0]}-{r}-{int(delay)}"
                        res = round_once(lab, work, tok, enc, sock, delay, lengths, step,
                                         samples, name)
                        results.setdefault(f"{label} @ {int(delay)} ms", []).append(res)
                        print(f"  {name}: {res}", flush=True)
    rows = []
    print(f"\n{'workload':<18}{'0 ms samples/s':>16}{f'{args.delay_ms:.0f} ms samples/s':>18}"
          f"{'ratio (median)':>16}")
    for label in WORKLOADS:
        base = [x["samples_per_s"] for x in results[f"{label} @ 0 ms"]]
        slow = [x["samples_per_s"] for x in results[f"{label} @ {int(args.delay_ms)} ms"]]
        ratio = statistics.median(s / b for s, b in zip(slow, base, strict=True))
        rows.append({"workload": label, "base": base, "delayed": slow, "ratio": round(ratio, 3)})
        print(f"{label:<18}{', '.join(map(str, base)):>16}{', '.join(map(str, slow)):>18}"
              f"{ratio:>15.2f}x")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"delay_ms": args.delay_ms, "rows": rows,
                                          "rounds": results}, indent=2) + "\n")
    print(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
