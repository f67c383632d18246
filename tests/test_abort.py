"""Abort at close by exact rid (SGLang 0.5.23 matches ``/abort_request`` rids exactly): on
every kind of close, each request in flight is aborted by its rid on its server, so none
runs to completion and none is counted; and the reaper aborts a killed worker's requests.

The simulator answers as SGLang does by default (an unknown rid, or a prefix, aborts
nothing), and its request log shows every start, finish and abort with its rid and time.
With ``--kind vllm`` it answers as vLLM 0.32's token API does (an abort names
``generate-tokens-<rid>`` exactly): an operator's close and the reaper are run on both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
from conftest import CLI_HANG_S, Stack, wait_until
from test_budget import close_times, partition, records
from test_chaos import owned_by

from cli.stack import REPO
from datagen.generation import guard
from datagen.generation.follower import follow
from datagen.generation.job import Job
from producers.producer import Producer

CONCURRENCY = 8
# Each request would run ~30 s to its cap (3,000 tokens at 10 ms a step), far longer
# than any close takes: what is still in flight at a close was aborted, never finished.
LONG = ("--lengths", "fixed:3000", "--decode-step-s", "0.01")
MIXED = ("--lengths", "uniform:50:3000", "--decode-step-s", "0.01")


def started(stack: Stack, dataset: str = "B1") -> set[str]:
    return {e["rid"] for e in stack.sim_log() if e["event"] == "start"
            and e["dataset"] == dataset}


def run_until_in_flight(stack: Stack, sim_args: tuple[str, ...] = LONG, prompts: int = 12,
                        worker: dict[str, Any] | None = None, **settings: Any) -> Any:
    """A simulator, one worker, the producer; then wait until CONCURRENCY requests of B1
    run on the server (or the dataset closed first, as a commit may close it)."""
    stack.start_simulator(*sim_args)
    configured = stack.configure(data_dir=str(partition(stack.tmp, {"B1": prompts})),
                                 short_concurrency=CONCURRENCY, short_max_tokens=3000,
                                 abort_on_close=True, precise_admission=False, **settings)
    stack.worker("short", **(worker or {}))
    stack.wait_workers(1)
    ledger = stack.ledger()
    Producer(configured, stack.app(), ledger).run()
    wait_until(lambda: ledger.closed("B1") or (len(ledger.in_flight("B1")) == CONCURRENCY
                                               and len(started(stack)) == CONCURRENCY),
               60, what=f"{CONCURRENCY} requests of B1 running on the server")
    return ledger


def assert_in_flight_at_close_aborted(stack: Stack, ledger: Any, settings: Any,
                                      dataset: str = "B1") -> set[str]:
    """Every request in flight at the close was aborted by its exact rid; none ran to its
    end, none was counted or stored. Returns their rids."""
    follow(ledger, 0.3, app=stack.app(), timeout_s=120)
    closed_at = min(close_times(ledger, dataset))
    log = [e for e in stack.sim_log() if e["dataset"] == dataset]
    before = {e["rid"] for e in log if e["event"] == "start" and e["time"] <= closed_at}
    ended_before = {e["rid"] for e in log if e["event"] in ("finish", "abort")
                    and e["time"] <= closed_at}
    open_at_close = before - ended_before
    aborted = {e["rid"] for e in log if e["event"] == "abort"}
    finished = {e["rid"] for e in log if e["event"] == "finish"}
    counted = {v.split(" ")[0] for v in ledger.committed(dataset).values()}
    assert open_at_close, "nothing was in flight at the close"
    assert open_at_close <= aborted, open_at_close - aborted
    assert not open_at_close & finished
    assert not open_at_close & counted
    assert not open_at_close & {r["rid"] for r in records(settings, dataset)}
    assert not [e for e in log if e["event"] == "start" and e["time"] > closed_at]
    snap = ledger.snapshot(dataset)
    assert snap["in_flight"] == 0 and snap["stats"]["discarded_tokens"] > 0
    return open_at_close


KINDS = {"sglang": (), "vllm": ("--kind", "vllm")}  # the simulator's flags for each


@pytest.mark.parametrize("kind", KINDS)
def test_an_operator_close_aborts_every_request_in_flight(stack: Stack, kind: str) -> None:
    # Given: eight long requests in flight on a server of this kind
    ledger = run_until_in_flight(stack, (*LONG, *KINDS[kind]), server_kind=kind)

    # When: an operator closes the dataset, with the abort-on-close policy
    assert guard.close(stack.app(), ledger, "B1", "operator", abort_in_flight=True)

    # Then: each of the eight was aborted by its rid, none finished or counted
    assert len(assert_in_flight_at_close_aborted(stack, ledger, stack.settings())) == 8


def test_datagen_budget_lowered_live_aborts_every_request_in_flight(stack: Stack) -> None:
    # Given: eight long requests in flight under a large budget
    ledger = run_until_in_flight(stack, token_budget=10**7)

    # When: `datagen budget` lowers the budget below what is committed (0)
    result = subprocess.run([sys.executable, "-m", "cli.main", "budget", "B1", "0"], cwd=REPO,
                            env=dict(os.environ, **stack.env), capture_output=True, text=True,
                            timeout=CLI_HANG_S)
    assert result.returncode == 0 and "closed" in result.stdout, result.stderr

    # Then: each of the eight was aborted, none finished or counted
    assert len(assert_in_flight_at_close_aborted(stack, ledger, stack.settings())) == 8


def test_a_close_at_admission_aborts_every_request_in_flight(stack: Stack) -> None:
    # Given: eight long requests in flight and a worker thread to spare; the budget is
    # lowered in the ledger alone, so nothing closes until an admission sees it
    ledger = run_until_in_flight(stack, prompts=CONCURRENCY, token_budget=10**7,
                                 worker={"short_concurrency": CONCURRENCY + 1})
    ledger.set_budget("B1", 0)

    # When: one more sample of the dataset asks for admission
    some = Job.from_payload(json.loads(next(iter(ledger.pending("B1").values()))))
    guard.enqueue(stack.app(), replace(some, sample="B1-late"))
    wait_until(lambda: ledger.closed("B1") == "budget", 180, what="the admission to close B1")

    # Then: the worker whose admission closed it aborted each of the eight
    assert len(assert_in_flight_at_close_aborted(stack, ledger, stack.settings())) == 8


def test_a_commit_crossing_the_budget_aborts_the_requests_still_in_flight(
        stack: Stack) -> None:
    # Given: responses of 50 to 3,000 tokens, and a budget the first response crosses
    # When: the dataset runs to its budget (closed by the worker whose commit crossed it)
    ledger = run_until_in_flight(stack, MIXED, token_budget=40)

    # Then: the seven others in flight then were aborted, none finished or counted
    aborted = assert_in_flight_at_close_aborted(stack, ledger, stack.settings())
    assert ledger.closed("B1") == "budget" and len(aborted) >= 6


def test_max_samples_reached_aborts_the_requests_still_in_flight(stack: Stack) -> None:
    # Given: requests in flight of a worker that stops a dataset at one sample
    # When: the first sample is committed
    ledger = run_until_in_flight(stack, MIXED, token_budget=10**7, worker={"max_samples": 1})

    # Then: the dataset closed for max_samples and the others were aborted
    aborted = assert_in_flight_at_close_aborted(stack, ledger, stack.settings())
    assert ledger.closed("B1") == "max_samples" and len(aborted) >= 6
    assert ledger.snapshot("B1")["stats"]["samples"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_the_reaper_aborts_a_killed_workers_requests_on_the_server(stack: Stack,
                                                                   kind: str) -> None:
    # Given: a worker with long requests in flight, and a second one whose reaper runs
    stack.start_simulator(*LONG, *KINDS[kind])
    settings = stack.configure(data_dir=str(partition(stack.tmp, {"B1": 12})),
                               short_concurrency=4, short_max_tokens=3000, server_kind=kind)
    victim = stack.worker("short", name="victim@%h")
    stack.worker("short", name="survivor@%h")
    stack.wait_workers(2)
    ledger = stack.ledger()
    Producer(settings, stack.app(), ledger).run()
    wait_until(lambda: sum(owned_by(e, victim) for e in ledger.in_flight("B1").values()) == 4
               and len(started(stack)) == 8, 60, what="both workers' requests running")
    lost = {e["rid"] for e in ledger.in_flight("B1").values() if owned_by(e, victim)}

    # When: the victim is killed with SIGKILL mid-request, and its leases go stale
    victim.kill()

    # Then: the survivor's reaper aborted each of the victim's requests by its rid (they
    # would decode on to their caps beside their re-runs), and re-enqueued their samples
    def aborted() -> set[str]:
        return {e["rid"] for e in stack.sim_log() if e["event"] == "abort"}
    wait_until(lambda: lost <= aborted(), 180, what="the dead worker's requests aborted")
    assert not lost & {e["rid"] for e in stack.sim_log() if e["event"] == "finish"}
    assert ledger.snapshot("B1")["stats"]["reaped"] >= len(lost)
