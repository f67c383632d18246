"""Aborts on a real SGLang: a budget close with ``abort_on_close``, and the reaper.

What the server did is read from its own logs (``cli/sglang_log.py``), not from the
pipeline: a request it finished by its cap or the model is ``length``/``stop``, one it
aborted is ``abort``. Measured on SGLang 0.5.23: a non-streaming request whose client
process dies (SIGKILL closes its sockets) is aborted by the server itself ("Request is
disconnected from the client side", no ``request.finished`` row); a client that is frozen
or cut off the network keeps its connection open, so only an ``/abort_request`` with its
exact rid stops it.

The caps of the long prompts (2,048 tokens) are far longer than what these tests let the
server decode (it does ~200 tokens/s for one request at best here), so every request in
flight at a close or a reap has well over a second of decoding left: one that is not
aborted is still decoding long after, and one that runs on is seen as such.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests
from conftest import Stack, wait_until, write_jsonl
from sglang_fixture import RealServer, unique_dataset

from cli.sglang_log import Served
from cli.stack import REPO, Process, child_env
from datagen.generation.merge import merge_dataset
from producers.producer import Producer

# Each waits on the shared server, which decoded ~1-10 tokens/s on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SHORT_CAP, LONG_CAP = 16, 2048
LONG_THRESHOLD = 60
# How long a request the pipeline asked to abort may take to end on the server: the
# answer comes within ~0.4 s (measured); this only bounds a wait that fails otherwise.
ABORT_WAIT_S = 180


def make_partition(root: Path, dataset: str, short: int, long: int) -> Path:
    rows = [{"id": f"s{i}", "prompt": f"Say hello number {i}"} for i in range(short)]
    rows += [{"id": f"l{i}", "prompt": " ".join(f"word{i}x{j}" for j in range(40))}
             for i in range(long)]  # over LONG_THRESHOLD tokens: the long queue
    write_jsonl(root / "partition" / f"{dataset}.jsonl", rows)
    return root / "partition"


def configure(stack: Stack, server: RealServer, part: Path, **settings: Any) -> Any:
    return stack.configure(
        server_url=server.url, data_dir=str(part), tokenizer_path=str(server.model_dir),
        sampling_params={"temperature": 0}, short_max_tokens=SHORT_CAP,
        long_max_tokens=LONG_CAP, long_threshold_tokens=LONG_THRESHOLD, lease_s=3.0,
        read_timeout_s=900.0, abort_on_close=True, **settings)


def rids_of(ledger: Any, dataset: str, proc: Process) -> set[str]:
    """The rids ``proc`` has in flight (owner ids are host-pid-random)."""
    owner = f"{socket.gethostname()}-{proc.pid}-"
    return {e["rid"] for e in ledger.in_flight(dataset).values()
            if str(e["worker"]).startswith(owner)}


def ended_as_abort(server: RealServer, entry: Served | None, rid: str) -> bool:
    return (entry is not None and entry.finish == "abort") or rid in server.disconnected()


def abort_leftovers(server: RealServer, rids: set[str]) -> None:
    """Spare the shared server what a failed test left decoding."""
    for rid in rids:
        requests.post(f"{server.url}/abort_request", json={"rid": rid}, timeout=30)


def test_the_reaper_aborts_a_lost_workers_requests_on_the_server(
        stack: Stack, real_sglang: RealServer) -> None:
    # Given: a worker with two long requests decoding on the real server, and a second
    # worker (of the other queue) whose heartbeat runs the reaper
    dataset = unique_dataset("B1_reap")
    configure(stack, real_sglang, make_partition(stack.tmp, dataset, 0, 2),
              long_concurrency=2)
    victim = stack.worker("long", name="victim@%h")
    stack.worker("short", name="keeper@%h")
    stack.wait_workers(2)
    ledger = stack.ledger()
    Producer(stack.settings(), stack.app(), ledger).run()
    wait_until(lambda: len(rids_of(ledger, dataset, victim)) == 2
               and len(real_sglang.decoding(dataset, rids_of(ledger, dataset, victim))) == 2,
               300, what="the victim's two requests decoding on the server")
    lost = rids_of(ledger, dataset, victim)

    # When: the worker freezes (SIGSTOP: as a host cut off the network, its connections
    # stay open, so the server cannot see it go) and its leases go stale
    victim.signal(signal.SIGSTOP)
    try:
        wait_until(lambda: ledger.snapshot(dataset)["stats"].get("reaped", 0) >= 2, 120,
                   what="the reaper to reclaim both samples")
        # Then: the server stopped decoding both: their exact rids were aborted
        try:
            wait_until(lambda: not real_sglang.decoding(dataset, lost), ABORT_WAIT_S,
                       what="the lost requests to end on the server")
        except AssertionError:
            still = real_sglang.decoding(dataset, lost)
            pytest.fail(f"{len(still)} of the reaped worker's requests still decoding on the "
                        f"server {ABORT_WAIT_S}s after the reap: not aborted ({sorted(still)})")
        log = real_sglang.served(dataset)
        for rid in lost:
            assert log[rid].finish == "abort", log[rid]
            assert log[rid].completion_tokens < LONG_CAP, log[rid]
        assert ledger.in_flight(dataset) == {}
        assert len(ledger.pending(dataset)) == 2  # re-enqueued, for a live long worker
    finally:
        victim.kill()  # SIGKILL ends a stopped process too; the server then drops the rest
        abort_leftovers(real_sglang, lost)


def test_a_budget_close_with_abort_stops_what_is_in_flight_and_counts_none_of_it(
        stack: Stack, real_sglang: RealServer) -> None:
    # Given: a dataset of short (cap 16) and long (cap 2,048) prompts, a short worker and
    # two long ones, abort_on_close on
    dataset = unique_dataset("B1_close")
    configure(stack, real_sglang, make_partition(stack.tmp, dataset, 8, 6),
              short_concurrency=2, long_concurrency=2, budgets={dataset: 10**9})
    stack.worker("short")
    victim = stack.worker("long", name="victim@%h")
    survivor = stack.worker("long", name="survivor@%h")
    stack.wait_workers(3)
    ledger = stack.ledger()
    settings = stack.settings()
    Producer(settings, stack.app(), ledger).run()
    wait_until(lambda: len(real_sglang.decoding(dataset, rids_of(ledger, dataset, victim)))
               == 2, 300, what="two of the victim's requests decoding on the server")

    # When: one long worker is SIGKILLed mid-run, and its samples are reclaimed ...
    killed = rids_of(ledger, dataset, victim)
    victim.kill()
    wait_until(lambda: ledger.snapshot(dataset)["stats"].get("reaped", 0) >= 2, 120,
               what="the reaper to reclaim the killed worker's samples")
    # ... and once records are stored and the survivor has two long requests decoding,
    # the operator closes the dataset by budget
    wait_until(lambda: ledger.snapshot(dataset)["stats"].get("samples", 0) >= 2
               and len(real_sglang.decoding(dataset, rids_of(ledger, dataset, survivor)))
               == 2, 600, what="2 records stored and 2 long requests decoding")
    result = subprocess.run([sys.executable, "-m", "cli.main", "budget", dataset, "1"],
                            cwd=REPO, env=child_env(stack.env), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "closed" in result.stdout, result.stderr[-2000:]
    closed_at = min(e["t"] for e in ledger.events(dataset) if e["e"].startswith("closed"))

    # Then: nothing of the dataset goes on decoding on the server
    everything = set(real_sglang.served(dataset))
    try:
        wait_until(lambda: not real_sglang.decoding(dataset, everything), ABORT_WAIT_S,
                   what="every request of the closed dataset to end on the server")
    except AssertionError:
        still = real_sglang.decoding(dataset, everything)
        abort_leftovers(real_sglang, still)
        pytest.fail(f"{len(still)} requests of the closed dataset still decoding on the "
                    f"server {ABORT_WAIT_S}s after the close: not aborted ({sorted(still)})")
    wait_until(lambda: ledger.in_flight(dataset) == {}, 120, what="nothing in flight")

    # ... every stored prompt is stored once, and the ledger equals the records
    committed = ledger.committed(dataset)
    merged = merge_dataset(settings.output_dir, dataset, committed)
    assert merged.duplicates == 0
    recs = [json.loads(x) for x in Path(merged.path).read_text().splitlines()]
    assert len(recs) == len({r["id"] for r in recs}) == len(committed)
    snap = ledger.snapshot(dataset)
    assert snap["tokens"] == sum(r["trainable_tokens"] for r in recs)
    assert snap["stats"]["samples"] == len(recs)
    assert all(r["finish_reason"]["type"] != "abort" for r in recs)

    # ... every request the server finished normally is a stored record, and the tokens of
    # every request it aborted for a live worker are counted as discarded, no more
    log = real_sglang.served(dataset)
    counted_rids = {v.split(" ")[0] for v in committed.values()}
    normal = {rid for rid, e in log.items() if e.normal}
    assert normal <= counted_rids, sorted(normal - counted_rids)
    assert {r["rid"] for r in recs} == counted_rids
    answered_aborts = [e for rid, e in log.items() if e.finish == "abort" and rid not in killed]
    assert snap["stats"].get("discarded_tokens", 0) == \
        sum(e.completion_tokens for e in answered_aborts)
    # ... the killed worker's requests ended as aborts, not at their caps
    assert all(ended_as_abort(real_sglang, log.get(rid), rid) for rid in killed), killed

    # ... and of the requests in flight at the close with more than 1 s of decoding left
    # (all but those that ended normally within 1 s of it), none ran to completion and
    # none was counted
    at_close = {rid: e for rid, e in log.items() if rid not in killed
                and e.received < closed_at and e.finished is not None
                and e.finished > closed_at}
    with_time_left = {rid: e for rid, e in at_close.items()
                      if not (e.normal and e.finished <= closed_at + 1.0)}
    assert len(with_time_left) >= 2, at_close  # the survivor's two long requests at least
    ran_on = {rid: e.finish for rid, e in with_time_left.items() if e.finish != "abort"}
    assert ran_on == {}, ran_on
    assert not set(with_time_left) & counted_rids
    print(f"FIGURE close: {len(with_time_left)} requests in flight at the close with > 1 s "
          f"left: {len(ran_on)} ran to completion, "
          f"{len(set(with_time_left) & counted_rids)} counted; last one ended "
          f"{max(e.finished for e in with_time_left.values()) - closed_at:.2f}s after it")
