"""Generation through the real SGLang router (`sglang-router` from PyPI) in front of two
simulators: the per-server limit, the budget stop and aborts behind it.

What the router does, read from its source and checked here (sglang-router 0.3.2):
it proxies `/generate` unchanged (rid included) but drops our `X-Datagen-Dataset` header,
has no `/abort_request` route (404) and no `/server_info` with a context length; it lists
its servers at `GET /workers`. Only `cache_aware` counts requests in flight per server, and
only with balance thresholds of 0 / 1.0 does it send each request to the least loaded
server, which is what keeps each server within its share of the workers' concurrency.
"""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

import pytest
import requests
from conftest import Stack, wait_until, write_jsonl
from test_budget import close_times, produce_and_wait, records

from cli.stack import Process
from datagen.client import Generation, SGLangClient, new_rid, rid_prefix
from datagen.redis_server import free_port
from producers.producer import Producer

# The router settings DEPLOY.md gives: shortest queue by the router's own count.
ROUTER_POLICY = ["--policy", "cache_aware", "--balance-abs-threshold", "0",
                 "--balance-rel-threshold", "1.0"]
SERVER_LIMIT = 4  # each simulator's batch; the workers run the sum of both
CONTEXTS = (8192, 6144)


@dataclass
class Routed:
    url: str
    servers: list[str]
    process: Process


def start_router(stack: Stack, servers: list[str], *args: str) -> Routed:
    port = free_port()
    # A metrics port of its own: the default (29000) is taken by a router of a test that
    # another test process runs at the same time, and the router then panics at start.
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), "--prometheus-port", str(free_port()),
            "--worker-urls", *servers, "--log-level", "warn", *args]
    proc = Process("router", argv, stack.tmp / "logs" / "router.log")
    stack.procs.append(proc)
    url = f"http://127.0.0.1:{port}"

    def all_servers_healthy() -> bool:
        if not proc.alive():
            raise AssertionError(f"router exited:\n{proc.log_text()[-3000:]}")
        try:
            listed = requests.get(f"{url}/workers", timeout=2).json()["workers"]
        except (requests.RequestException, ValueError, KeyError):
            return False
        return sorted(w["url"] for w in listed if w["is_healthy"]) == sorted(servers)

    wait_until(all_servers_healthy, 180, what="the router to list both servers healthy")
    return Routed(url, servers, proc)


def start_routed(stack: Stack, *simulator_args: str) -> Routed:
    """Two simulators behind the router, which becomes the run's server_url."""
    # The simulators name the tiny tokenizer as their model, so the router loads it from
    # disk instead of looking the model up on the Hugging Face hub.
    servers = [stack.start_simulator("--max-running-requests", str(SERVER_LIMIT),
                                     "--mean-output-tokens", "200", "--sigma", "0.8",
                                     "--decode-step-s", "0.004",
                                     # the second as SGLang launched without --context-length
                                     "--context-length" if i == 0 else
                                     "--max-position-embeddings", str(ctx),
                                     "--model-path", str(stack.tokenizer_dir),
                                     *simulator_args, name=f"sim-{i}")
               for i, ctx in enumerate(CONTEXTS)]
    router = start_router(stack, servers, *ROUTER_POLICY)
    stack.sim_url = router.url
    return router


@pytest.fixture
def routed(stack: Stack) -> Routed:
    return start_routed(stack)


def journal(server: str) -> list[dict[str, Any]]:
    return requests.get(f"{server}/_sim/log", timeout=10).json()


def stats(server: str) -> dict[str, Any]:
    return requests.get(f"{server}/_sim/stats", timeout=10).json()


def of_dataset(entries: list[dict[str, Any]], dataset: str, event: str) -> list[dict[str, Any]]:
    # The router drops the dataset header: the rid's fixed prefix names the dataset.
    return [e for e in entries if e["event"] == event
            and str(e["rid"]).startswith(rid_prefix(dataset))]


def test_through_the_router_each_server_keeps_its_limit_and_the_budget_stop_holds(
        stack: Stack, routed: Routed) -> None:
    # Given: workers running both servers' limits together, through the router; no
    # context_length setting, so the producer must learn it behind the router
    prompts = [{"id": f"B1-{i}", "prompt": f"Tell me about topic {i}"} for i in range(150)]
    write_jsonl(stack.tmp / "partition" / "B1.jsonl", prompts)
    budget = 15_000
    settings = stack.configure(data_dir=str(stack.tmp / "partition"),
                               short_concurrency=2 * SERVER_LIMIT, short_max_tokens=1200,
                               token_budget=budget)
    stack.worker("short")
    stack.wait_workers(1)

    # When: the dataset runs to its budget
    ledger = produce_and_wait(stack, settings, timeout_s=200)

    # Then: both servers worked, neither ever had more than its limit open at once
    peaks = {s: stats(s) for s in routed.servers}
    for server, seen in peaks.items():
        assert seen["requests_started"] > 0, (server, peaks)
        assert seen["peak_in_flight"] <= SERVER_LIMIT, (server, peaks)
    # ... the dataset closed at its budget, counted once per record, past it by no more than
    # what was in flight at the close could add (each request at most its cap). How close to
    # the budget it lands is test_budget.py's and bench_budget.py's subject; here the random
    # lengths of 8 requests in flight at once decide it.
    snap = ledger.snapshot("B1")
    assert snap["closed"] == "budget"
    assert 0 <= snap["tokens"] - budget <= 2 * SERVER_LIMIT * 1200, snap
    assert snap["tokens"] == sum(r["trainable_tokens"] for r in records(settings, "B1"))
    assert snap["stats"]["samples"] < len(prompts)
    # ... and no request of it reached either server after the close
    closed_at = min(close_times(ledger, "B1"))
    late = [e for s in routed.servers for e in of_dataset(journal(s), "B1", "start")
            if e["time"] > closed_at]
    assert late == []


def test_an_abort_sent_to_the_router_reaches_the_server_running_the_request(
        stack: Stack, routed: Routed) -> None:
    client = SGLangClient(routed.url, read_timeout_s=120)
    # The router itself has no /abort_request: the reason the client asks its servers.
    assert requests.post(f"{routed.url}/abort_request", json={"rid": "x"},
                         timeout=10).status_code == 404

    # Given: one long request in flight through the router
    rid = new_rid("B7")
    result: dict[str, Generation] = {}
    thread = threading.Thread(target=lambda: result.setdefault("gen", client.generate(
        [5, 6, 7], {"max_new_tokens": 5000, "ignore_eos": True}, rid)))
    thread.start()

    def running_on() -> list[str]:
        return [s for s in routed.servers if of_dataset(journal(s), "B7", "start")]

    wait_until(lambda: running_on(), 120, what="the request to start on a server")
    [runner] = running_on()

    # When: the client aborts it by rid, with the router as its server
    client.abort(rid)
    thread.join(60)

    # Then: the server that ran it aborted it, and the call came back as aborted
    assert [e["rid"] for e in of_dataset(journal(runner), "B7", "abort")] == [rid]
    assert result["gen"].aborted
    assert result["gen"].completion_tokens < 5000
    assert client.backends() == sorted(routed.servers)


def test_the_limits_behind_the_router_are_the_smallest_servers(routed: Routed) -> None:
    # sim-0 was launched with --context-length, sim-1 as SGLang is by default (its
    # /server_info context_length null, the model's own length in /v1/models)
    assert requests.get(f"{routed.url}/server_info", timeout=10).status_code == 404
    assert requests.get(f"{routed.servers[1]}/server_info",
                        timeout=10).json()["context_length"] is None
    limits = SGLangClient(routed.url).limits()
    assert limits.context_length == min(CONTEXTS)
    assert limits.max_input_tokens == min(CONTEXTS) - 6  # each server's max_req_input_len
    assert "/v1/models max_model_len" in limits.source


def test_abort_on_close_through_the_router_stops_the_requests_on_every_server(
        stack: Stack, routed: Routed) -> None:
    # Given: long responses on both servers, a small budget and the abort-on-close policy
    write_jsonl(stack.tmp / "partition" / "B1.jsonl",
                [{"id": f"B1-{i}", "prompt": f"Explain idea {i}"} for i in range(40)])
    settings = stack.configure(data_dir=str(stack.tmp / "partition"),
                               short_concurrency=2 * SERVER_LIMIT, short_max_tokens=3000,
                               token_budget=600, abort_on_close=True, precise_admission=False,
                               context_length=min(CONTEXTS))
    stack.worker("short")
    stack.wait_workers(1)

    # When: the dataset closes with requests in flight on both servers
    ledger = produce_and_wait(stack, settings)

    # Then: the close's aborts reached the servers through the router's server list, the
    # aborted outputs were discarded, and nothing partial was stored
    aborted = {s: of_dataset(journal(s), "B1", "abort") for s in routed.servers}
    assert any(aborted.values()), aborted
    snap = ledger.snapshot("B1")
    assert snap["closed"] == "budget" and snap["stats"]["discarded_tokens"] > 0
    stored = records(settings, "B1")
    assert stored and all(r["finish_reason"]["type"] != "abort" for r in stored)
    assert snap["in_flight"] == 0


def test_a_stopping_worker_behind_the_router_aborts_its_requests_on_their_servers(
        stack: Stack) -> None:
    # Given: a worker with requests in flight on both servers that outlast its 1 s grace
    routed = start_routed(stack, "--lengths", "fixed:2500", "--decode-step-s", "0.01")
    write_jsonl(stack.tmp / "partition" / "B1.jsonl",
                [{"id": f"B1-{i}", "prompt": f"Describe case {i}"} for i in range(12)])
    settings = stack.configure(data_dir=str(stack.tmp / "partition"),
                               short_concurrency=2 * SERVER_LIMIT, short_max_tokens=3000,
                               token_budget=10**7, shutdown_grace_s=1.0,
                               context_length=min(CONTEXTS))
    worker = stack.worker("short")
    stack.wait_workers(1)
    ledger = stack.ledger()
    Producer(settings, stack.app(), ledger).run()
    # (the ledger counts a request at admission, before its /generate reaches a server: wait
    # for the servers' own logs too, or a slow last request starts, and is aborted, unseen)
    def started() -> set[str]:
        return {e["rid"] for s in routed.servers for e in of_dataset(journal(s), "B1", "start")}

    wait_until(lambda: len(ledger.in_flight("B1")) == 2 * SERVER_LIMIT
               and len(started()) == 2 * SERVER_LIMIT, 180,
               what="both servers' share in flight and started on them")
    rids = started()

    # When: it gets SIGTERM
    worker.signal(signal.SIGTERM)
    worker.proc.wait(timeout=60)

    # Then: every request it had open was aborted on the server running it, and their
    # samples are back in the ledger's hands, none half-stored
    aborted = {e["rid"] for s in routed.servers for e in of_dataset(journal(s), "B1", "abort")}
    assert rids and aborted == rids
    assert ledger.in_flight("B1") == {}
    assert records(settings, "B1") == []
