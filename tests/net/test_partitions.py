"""The fleet across hosts: silent partitions between real network stacks.

Redis, the server (the simulator), two worker hosts and a control host running `datagen
run` are network namespaces on a bridge (tests/net/lab.py); a cut drops every packet
between two hosts without a reset, as a real partition does. Each case is checked from the
server's request log, the records and the ledger: nothing lost, nothing counted twice, no
live request reaped, the run finishing by itself, no traceback for a network event.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import CLI_HANG_S, wait_until, write_jsonl
from net.lab import Lab

from cli.stack import REPO, Process, child_env
from config.settings import Settings, load_settings
from datagen import keys
from datagen.generation.ledger import Ledger, connect
from datagen.generation.merge import merge_dataset

pytestmark = [pytest.mark.chaos, pytest.mark.net]
REDIS_PORT, SERVER_PORT = 6379, 30000
WORKERS = ("w1", "w2")


@dataclass
class Fleet:
    lab: Lab
    env: dict[str, str]
    sock: Path
    requests_log: Path
    sim_args: tuple[str, ...]
    vocab: tuple[int, int]  # vocabulary size, eos id
    procs: dict[str, Process] = field(default_factory=dict)
    servers: list[Process] = field(default_factory=list)  # the last one running

    @property
    def settings(self) -> Settings:
        return load_settings(None, env=self.env)

    def ledger(self) -> Ledger:
        return Ledger(connect(f"unix://{self.sock}"), self.settings)

    def start_server(self) -> Process:
        """A simulator on the server host (one request log for all of them)."""
        vocab, eos = self.vocab
        sim = self.lab.spawn("server", f"simulator-{len(self.servers)}", [
            sys.executable, "-u", "-m", "simulator", "--host", self.lab.hosts["server"].ip,
            "--port", str(SERVER_PORT), "--vocab-size", str(vocab), "--eos-token-id",
            str(eos), "--request-log", str(self.requests_log), *self.sim_args])
        self.lab.wait_log(sim, "SIMULATOR_READY")
        self.servers.append(sim)
        return sim

    def worker(self, host: str, **settings: str) -> Process:
        env = {**self.env, **{f"DATAGEN_{k.upper()}": v for k, v in settings.items()}}
        proc = self.lab.spawn(host, f"worker-{host}", [
            sys.executable, "-m", "cli.main", "worker", "short", "-n", f"{host}@%h"],
            child_env(env))
        self.procs[host] = proc
        return proc

    def run(self) -> Process:
        proc = self.lab.spawn("control", "run", [
            sys.executable, "-m", "cli.main", "run", "--interval", "0.5"], child_env(self.env))
        self.procs["run"] = proc
        return proc

    def starts(self) -> list[dict[str, Any]]:
        lines = self.requests_log.read_text().splitlines() if self.requests_log.exists() else []
        return [e for e in map(json.loads, lines) if e["event"] == "start"]

    def roomy_w2(self) -> None:
        """w2 again with 8 threads: room for the samples it must re-run at once."""
        self.procs.pop("w2").stop()
        self.worker("w2", short_concurrency="8")
        wait_until(lambda: " ready." in self.procs["w2"].log_text(), 600, what="w2 up again")

    def wait_w1_running_two(self) -> None:
        """Until both of w1's requests run on the server (a request still on its way when a
        cut begins arrives after the heal and runs although its sample ran elsewhere,
        RELIABILITY.md "Across hosts")."""
        wait_until(lambda: self.running_on_server("w1", 2), 600,
                   what="w1 with 2 requests running on the server")

    def in_flight_of(self, host: str) -> dict[str, str]:
        """Sample -> rid of the requests the worker on ``host`` has in flight."""
        pid = self.procs[host].pid
        return {s: e["rid"] for s, e in self.ledger().in_flight("B1").items()
                if f"-{pid}-" in str(e["worker"])}

    def running_on_server(self, host: str, count: int) -> bool:
        """``count`` requests of the worker on ``host`` in flight, each started on the server."""
        flying = self.in_flight_of(host)
        started = {e["rid"] for e in self.starts()}
        return len(flying) == count and set(flying.values()) <= started

    def started_again(self, lost: dict[str, str], since: float) -> dict[str, float]:
        """Seconds from ``since`` to the start of each lost sample's counted request, which
        must be a new one (another rid)."""
        counted = {s: v.split(" ")[0] for s, v in self.ledger().committed("B1").items()}
        assert all(counted[s] != rid for s, rid in lost.items())
        return {s: min(e["time"] for e in self.starts() if e["rid"] == counted[s]) - since
                for s in lost}

    def wait_exit(self, proc: Process, timeout_s: float = 600.0) -> int:
        wait_until(lambda: not proc.alive(), timeout_s, 0.2, what=f"{proc.name} to exit")
        return proc.proc.returncode


@pytest.fixture
def fleet(request: pytest.FixtureRequest, can_make_hosts: None, tmp_path: Path,
          tokenizer_dir: Path, encoder: Any) -> Iterator[Fleet]:
    """Hosts redis, server, w1, w2 and control; Redis and the server started on theirs."""
    samples, lease_s, sim_args = request.param
    gw = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    with Lab(tmp_path, int(gw) if gw.isdigit() else 0) as lab:
        for name in ("redis", "server", *WORKERS, "control"):
            lab.host(name)
        sock = lab.start_redis("redis", REDIS_PORT)
        wait_until(lambda: _pings(sock), 120, what="Redis on its host")
        write_jsonl(tmp_path / "partition" / "B1.jsonl",
                    [{"id": f"B1-{i:03d}", "prompt": f"question number {i}"}
                     for i in range(samples)])
        values = {"redis_url": f"redis://{lab.hosts['redis'].ip}:{REDIS_PORT}/0",
                  "server_url": f"http://{lab.hosts['server'].ip}:{SERVER_PORT}",
                  "output_dir": str(tmp_path / "out"), "data_dir": str(tmp_path / "partition"),
                  "tokenizer_path": str(tokenizer_dir), "lease_s": str(lease_s),
                  "short_concurrency": "2", "short_max_tokens": "2000",
                  "retry_backoff_s": "0.2", "read_timeout_s": "300"}
        fleet = Fleet(lab, {f"DATAGEN_{k.upper()}": v for k, v in values.items()}, sock,
                      tmp_path / "requests.jsonl", tuple(sim_args),
                      (encoder.vocab_size, encoder.eos_token_id))
        fleet.start_server()
        for host in WORKERS:
            fleet.worker(host)
        wait_until(lambda: _alive_workers(sock) >= len(WORKERS), 600, 0.2,
                   what="both workers up")
        yield fleet


def _pings(sock: Path) -> bool:
    try:
        return bool(redis.Redis(unix_socket_path=str(sock)).ping())
    except redis.RedisError:
        return False


def _alive_workers(sock: Path) -> int:
    client = redis.Redis(unix_socket_path=str(sock))
    return sum(1 for _ in client.scan_iter(keys.worker_alive("*")))


def assert_exact(fleet: Fleet, expected: int, reruns: bool = False) -> list[dict[str, Any]]:
    """Every sample stored once and counted once; each started on the server once (unless
    ``reruns``: then only what was reaped started again)."""
    ledger = fleet.ledger()
    report = merge_dataset(fleet.settings.output_dir, "B1", ledger.committed("B1"))
    merged = [json.loads(x) for x in Path(report.path).read_text().splitlines()]
    assert len(merged) == len({r["id"] for r in merged}) == expected
    snap = ledger.snapshot("B1")
    assert snap["stats"]["samples"] == expected
    assert snap["tokens"] == sum(r["trainable_tokens"] for r in merged)
    if not reruns:
        assert snap["stats"].get("reaped", 0) == 0, "a live request was taken for a dead one"
    assert len(fleet.starts()) == expected + snap["stats"].get("reaped", 0), \
        "a sample was generated twice without being reaped"
    assert ledger.in_flight("B1") == {} and ledger.pending("B1") == {}
    return merged


def assert_no_traceback(fleet: Fleet) -> None:
    for name, proc in fleet.procs.items():
        text = proc.log_text()
        assert "Traceback" not in text and "raised unexpected" not in text, (
            name, text[-3000:])


@pytest.mark.parametrize("fleet", [(12, 6.0, ("--lengths", "fixed:300",
                                               "--decode-step-s", "0.02"))], indirect=True)
def test_redis_unreachable_for_every_host_for_two_leases_reaps_no_live_request(
        fleet: Fleet) -> None:
    # Given: `datagen run` following, two workers with 6 s requests in flight (lease 6 s)
    run = fleet.run()
    ledger = fleet.ledger()
    wait_until(lambda: len(ledger.in_flight("B1")) == 4, 600, what="4 requests in flight")

    # When: Redis is unreachable for every host for 15 s (packets dropped, no reset)
    others = [h for h in fleet.lab.hosts if h != "redis"]
    fleet.lab.cut_from("redis", others)
    time.sleep(15.0)  # the outage's length, not a wait for an event
    fleet.lab.heal_from("redis", others)

    # Then: the run finishes by itself, every sample generated, stored and counted once,
    # no live request reaped, no traceback; the workers said what they waited for
    assert fleet.wait_exit(run) == 0, run.log_text()[-3000:]
    assert_exact(fleet, 12)
    assert_no_traceback(fleet)
    logs = "".join(fleet.procs[w].log_text() for w in WORKERS)
    assert "waits for the ledger" in logs or "Redis unreachable" in logs
    print(f"FIGURE net-redis-away: 15 s outage, lease 6 s: 0 reaped, "
          f"{len(fleet.starts())} requests for 12 samples")


@pytest.mark.parametrize("fleet", [(24, 24.0, ("--lengths", "fixed:150",
                                               "--decode-step-s", "0.02"))], indirect=True)
def test_a_worker_cut_from_redis_for_less_than_a_lease_keeps_its_finished_work(
        fleet: Fleet) -> None:
    # Given: a run of 3 s requests on two workers (lease 24 s)
    run = fleet.run()
    ledger = fleet.ledger()
    wait_until(lambda: len(ledger.in_flight("B1")) == 4, 600, what="4 requests in flight")

    # When: w1 cannot reach Redis for 14 s (past the clients' 10 s reply timeout, short of
    # the 16 s a lease can have left) while its requests finish on the server
    fleet.lab.cut("w1", "redis")
    cut_at = time.time()
    time.sleep(14.0)  # the cut's length, not a wait for an event
    fleet.lab.heal("w1", "redis")
    healed_at = time.time()

    # Then: the generations w1 finished during the cut are counted once Redis is back,
    # nothing is generated twice or reaped, and the run finishes by itself
    assert fleet.wait_exit(run) == 0, run.log_text()[-3000:]
    merged = assert_exact(fleet, 24)
    assert_no_traceback(fleet)
    w1_pid = fleet.procs["w1"].pid
    mine = {r["rid"] for r in merged if f"-{w1_pid}-" in r["worker"]}
    ends = {e["rid"]: e["time"] for e in map(json.loads, fleet.requests_log.read_text()
                                             .splitlines()) if e["event"] == "finish"}
    assert any(cut_at < ends.get(rid, 0) < healed_at for rid in mine), \
        "no generation of w1 finished during the cut: the case did not happen"
    # ... and the healed worker took new work within 2 s of the heal
    later = sorted(e["time"] for e in fleet.starts() if e["rid"] in mine
                   and e["time"] > healed_at)
    assert later and later[0] - healed_at <= 2.0, (later[:1], healed_at)
    print(f"FIGURE net-redis-cut: w1 took new work {later[0] - healed_at:.2f}s after the "
          "heal; 0 reaped, 24 requests for 24 samples")


@pytest.mark.parametrize("fleet", [(12, 6.0, ("--lengths", "fixed:150",
                                               "--decode-step-s", "0.02"))], indirect=True)
def test_a_worker_cut_from_its_server_only_has_its_requests_run_elsewhere_in_time(
        fleet: Fleet) -> None:
    # Given: w1 (2 threads) and a second worker with room to spare, 3 s requests, lease 6 s
    fleet.roomy_w2()
    run = fleet.run()
    ledger = fleet.ledger()
    fleet.wait_w1_running_two()

    # When: w1 can reach Redis but not the server (its requests hang, nothing resets)
    lost = fleet.in_flight_of("w1")
    fleet.lab.cut("w1", "server")
    cut_at = time.time()
    wait_until(lambda: all(s in ledger.committed("B1") for s in lost), 120,
               what="w1's samples stored by another worker")
    fleet.lab.heal("w1", "server")
    wait_until(lambda: "consuming again from short" in fleet.procs["w1"].log_text(), 60,
               what="w1 to take work again once it reaches the server")

    # Then: they started again elsewhere within a lease and 2 s of the cut, were counted
    # once, and the run finished by itself with no traceback
    assert fleet.wait_exit(run) == 0, run.log_text()[-3000:]
    assert_exact(fleet, 12, reruns=True)
    assert_no_traceback(fleet)
    # A lease and 2 s: the heartbeat finds the server lost within a beat and the probe's
    # connect timeout (2 + 3 s here) and ends the leases; another worker's next beat reaps
    again = fleet.started_again(lost, cut_at)
    assert all(0 < t <= fleet.settings.lease_s + 2 for t in again.values()), again
    w1_log = fleet.procs["w1"].log_text()
    assert "stopped consuming" in w1_log
    # its two stranded requests were dropped, not left waiting for read_timeout_s (300 s
    # here): their threads ended during the cut, their leases ended, not released
    assert "dropped 2 requests waiting on the unreachable server" in w1_log
    assert w1_log.count("its lease ended for a worker that reaches it") >= 2
    print(f"FIGURE net-server-cut: {len(lost)} stranded requests started again "
          f"{min(again.values()):.1f}-{max(again.values()):.1f}s after the cut (lease "
          f"{fleet.settings.lease_s:.0f}s)")


@pytest.mark.parametrize("fleet", [(12, 6.0, ("--lengths", "fixed:150",
                                               "--decode-step-s", "0.02"))], indirect=True)
def test_a_worker_cut_from_everything_for_two_leases_with_no_follower(fleet: Fleet) -> None:
    # Given: a run produced by `datagen produce` alone (no `datagen run` follows it), w1 of
    # 2 threads and w2 with room to spare (a re-run waits for no free thread), 3 s
    # requests, lease 6 s
    fleet.roomy_w2()
    produced = fleet.lab.spawn("control", "produce", [
        sys.executable, "-m", "cli.main", "produce"], child_env(fleet.env))
    assert fleet.wait_exit(produced) == 0, produced.log_text()[-3000:]
    ledger = fleet.ledger()
    fleet.wait_w1_running_two()

    # When: w1's host is cut from every other host for two leases
    lost = fleet.in_flight_of("w1")
    others = [h for h in fleet.lab.hosts if h != "w1"]
    fleet.lab.cut_from("w1", others)
    cut_at = time.time()
    time.sleep(2 * fleet.settings.lease_s)  # the cut's length, not a wait for an event
    fleet.lab.heal_from("w1", others)

    # Then: its requests started again on w2 within a lease and 2 s of the cut, and the run
    # finishes by itself, with no follower and no sweep: every sample counted once
    wait_until(lambda: len(ledger.committed("B1")) == 12, 600, 0.5,
               what="every sample stored, with no follower")
    assert_exact(fleet, 12, reruns=True)
    assert_no_traceback(fleet)
    again = fleet.started_again(lost, cut_at)
    assert all(0 < t <= fleet.settings.lease_s + 2 for t in again.values()), again
    print(f"FIGURE net-isolated: {len(lost)} requests of the cut worker started again "
          f"{min(again.values()):.1f}-{max(again.values()):.1f}s after the cut (lease "
          f"{fleet.settings.lease_s:.0f}s); the run finished with no follower")


@pytest.mark.parametrize("fleet", [(12, 6.0, ("--lengths", "fixed:150",
                                               "--decode-step-s", "0.02"))], indirect=True)
def test_a_worker_cut_from_redis_for_two_leases_has_its_requests_run_elsewhere_in_time(
        fleet: Fleet) -> None:
    # Given: `datagen run` following, w1 (2 threads) and w2 with room to spare, 3 s
    # requests, lease 6 s, both of w1's requests running on the server
    fleet.roomy_w2()
    run = fleet.run()
    fleet.wait_w1_running_two()

    # When: w1 cannot reach Redis for two leases (its requests finish on the server meanwhile,
    # their commits waiting for Redis)
    lost = fleet.in_flight_of("w1")
    fleet.lab.cut("w1", "redis")
    cut_at = time.time()
    time.sleep(2 * fleet.settings.lease_s)  # the cut's length, not a wait for an event
    fleet.lab.heal("w1", "redis")

    # Then: its samples started again on w2 within a lease and 2 s of the cut; w1's own
    # answers, finished in the cut, reached no count and no training file (their leases were
    # taken over); the run finished by itself, every sample counted once, no traceback
    assert fleet.wait_exit(run) == 0, run.log_text()[-3000:]
    merged = assert_exact(fleet, 12, reruns=True)
    assert_no_traceback(fleet)
    again = fleet.started_again(lost, cut_at)
    assert all(0 < t <= fleet.settings.lease_s + 2 for t in again.values()), again
    assert not set(lost.values()) & {r["rid"] for r in merged}
    ends = {e["rid"] for e in map(json.loads, fleet.requests_log.read_text().splitlines())
            if e["event"] == "finish"}
    assert set(lost.values()) <= ends, "w1's requests did not finish: the case did not happen"
    print(f"FIGURE net-redis-cut-long: {len(lost)} requests of the cut worker started again "
          f"{min(again.values()):.1f}-{max(again.values()):.1f}s after the cut (lease "
          f"{fleet.settings.lease_s:.0f}s); its own answers dropped, 12 of 12 counted once")


@pytest.mark.parametrize("fleet", [(12, 6.0, ("--lengths", "fixed:150",
                                               "--decode-step-s", "0.02"))], indirect=True)
def test_the_server_host_gone_and_replaced_strands_nothing(fleet: Fleet) -> None:
    # Given: `datagen run` following, two workers with 4 requests running on the server
    # (3 s each, lease 6 s, read timeout 300 s)
    run = fleet.run()
    ledger = fleet.ledger()
    wait_until(lambda: fleet.running_on_server("w1", 2) and fleet.running_on_server("w2", 2),
               600, what="4 requests running on the server")

    # When: the server host vanishes (cut from every host, its server killed with what it
    # ran) until both workers have stopped consuming; then a new server comes up at the
    # same address
    others = [h for h in fleet.lab.hosts if h != "server"]
    fleet.lab.cut_from("server", others)
    fleet.servers[-1].kill()
    wait_until(lambda: all("stopped consuming" in fleet.procs[w].log_text() for w in WORKERS),
               120, what="both workers to stop consuming")
    left = 12 - len(ledger.committed("B1"))
    fleet.start_server()
    fleet.lab.heal_from("server", others)
    back_at = time.time()

    # Then: nothing waited for the read timeout (300 s): every sample left started once on
    # the new server, the first within a lease and 2 s of its return (a thread whose
    # connection the new host reset left its sample to the reaper: its lease had ended when
    # the server was lost); every sample counted once, the run finished by itself with no
    # traceback
    assert fleet.wait_exit(run) == 0, run.log_text()[-3000:]
    ledger = fleet.ledger()
    merged = [json.loads(x) for x in Path(merge_dataset(
        fleet.settings.output_dir, "B1", ledger.committed("B1")).path).read_text().splitlines()]
    assert len({r["id"] for r in merged}) == len(merged) == 12
    assert ledger.snapshot("B1")["tokens"] == sum(r["trainable_tokens"] for r in merged)
    again = sorted(e["time"] - back_at for e in fleet.starts() if e["time"] >= back_at)
    assert len(again) == left, (left, again)
    assert 0 < again[0] <= fleet.settings.lease_s + 2, again
    assert_no_traceback(fleet)
    print(f"FIGURE net-server-gone: the {left} samples left started on the new server, the "
          f"first {again[0]:.1f}s after it came back (lease {fleet.settings.lease_s:.0f}s)")


def test_the_latency_bench_runs_and_short_requests_lose_more_than_long_ones(
        can_make_hosts: None, tmp_path: Path) -> None:
    # The command docs/BENCHMARKS.md gives, at a quarter of its size
    out = tmp_path / "net.json"
    done = subprocess.run([sys.executable, "bench/bench_net_latency.py", "--rounds", "1",
                           "--quick", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=CLI_HANG_S)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = {r["workload"]: r for r in json.loads(out.read_text())["rows"]}
    # 10 ms each way on every call: short requests lose far more than long ones
    assert rows["short (~50 ms)"]["ratio"] < rows["long (~3 s)"]["ratio"]
    assert "ratio (median)" in done.stdout
