"""The simulator answers as SGLang 0.5.23 does (issue 18 §4): the same requests go to a real
server and to a simulator configured like it (context 4096, the tiny model's vocabulary and
EOS), and their status codes, error texts, finish-reason shapes and meta_info keys are
compared. The speed, scale and fault tests stand on the simulator; this is what keeps it
honest.

What the simulator does not emulate, on purpose, is listed in NOT_EMULATED with the reason.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from conftest import REAL_CONTEXT_LENGTH, wait_until
from sglang_fixture import RealServer
from side_by_side import both, prompt, rid_of, sim_started

from cli import sglang
from cli.stack import start_simulator

VOCAB, EOS = 4096, 2  # the tiny model's (cli/sglang.py build_model)
TIMEOUT = (10, 300)
LIMIT = REAL_CONTEXT_LENGTH - 6  # max_req_input_len
QUEUED_ABORT_TRIES = 200

# Differences kept on purpose; each is either impossible or unwise to emulate.
NOT_EMULATED = {
    "input_ids past the vocabulary": "SGLang 0.5.23 does not check them: the embedding lookup "
    "raises in the scheduler and the whole server exits (seen here, an id of 5000 with "
    "vocab 4096). The simulator answers 400; such a request is never sent to the real one.",
    "n > 1": "SGLang answers a list of n results; the simulator refuses n != 1 with 400 "
    "(the pipeline never sends n).",
    "cached_tokens values": "SGLang's radix cache serves repeated prefixes (cached_tokens > 0, "
    "cached_tokens_details {device, host}); the simulator models no cache (0 and null). The "
    "keys are the same.",
    "FastAPI validation errors": "a rid of the wrong type or a body that is not JSON gets "
    "{'object': 'error', 'message': <pydantic text with the server's file paths>}; the "
    "pipeline sends neither.",
    "/server_info's other keys": "SGLang's ~556 launch arguments; the pipeline reads "
    "context_length, max_req_input_len and version, compared below.",
    "stop strings, text prompts": "the simulator's text is one word per token; the pipeline "
    "sends input_ids and no stop strings.",
}


@dataclass
class Target:
    """One server under comparison: its URL and how to tell that it received a rid."""

    name: str
    url: str
    received: Callable[[str], bool]

    def post(self, body: dict) -> requests.Response:
        return requests.post(f"{self.url}/generate", json=body, timeout=TIMEOUT)


def sim_args(context_length: int | None) -> list[str]:
    # Random weights rarely emit EOS, so the real server's answers run to max_new_tokens;
    # the simulator's do the same with a natural length past every cap used here.
    args = ["--vocab-size", str(VOCAB), "--eos-token-id", str(EOS), "--lengths", "fixed:30000",
            "--decode-step-s", "0.02"]
    return args + (["--context-length", str(context_length)] if context_length else [])


@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sim")


@pytest.fixture(scope="module")
def sim(sim_dir: Path) -> Iterator[str]:
    proc, url = start_simulator(sim_dir, sim_args(REAL_CONTEXT_LENGTH), name="sim-context")
    try:
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def pair(real_sglang_context: RealServer, sim: str) -> list[Target]:
    return [Target("sglang", real_sglang_context.url,
                   lambda rid: real_sglang_context.logged("request.received", rid)),
            Target("simulator", sim, sim_started(sim))]


def answer(resp: requests.Response, rid: str = "") -> tuple[int, Any]:
    """(status, body) with the rid written as <rid>, so two servers' answers compare."""
    text = resp.text.replace(rid, "<rid>") if rid else resp.text
    return resp.status_code, (json.loads(text) if text else None)


def shape(body: dict) -> dict:
    """What must match in a successful answer: everything but the values that differ."""
    meta = body["meta_info"]
    return {"keys": sorted(body), "meta_keys": sorted(meta),
            "finish_reason": meta["finish_reason"], "outputs": len(body["output_ids"]),
            "prompt_tokens": meta["prompt_tokens"],
            "completion_tokens": meta["completion_tokens"]}


def in_flight(target: Target, rid: str, cap: int) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(resp=target.post({
        "input_ids": prompt(8), "rid": rid,
        "sampling_params": {"max_new_tokens": cap, "temperature": 0}})), daemon=True)
    thread.start()
    wait_until(lambda: target.received(rid) or "resp" in out, timeout_s=120,
               what=f"{target.name} to receive {rid}")
    return thread, out


# --- the limits -----------------------------------------------------------------------------

def limits(url: str) -> dict:
    info = requests.get(f"{url}/server_info", timeout=30).json()
    models = requests.get(f"{url}/v1/models", timeout=30).json()
    return {"context_length": info["context_length"],
            "max_req_input_len": info["max_req_input_len"], "version": info["version"],
            "max_model_len": models["data"][0]["max_model_len"]}


def test_the_limits_of_a_context_length_launch(pair: list[Target]) -> None:
    real, simulated = both(pair, lambda t: limits(t.url))
    assert simulated == real


def test_the_limits_of_a_default_launch(real_sglang: RealServer, sim_dir: Path) -> None:
    # depends on the protocol branch: context_length null unless launched with one
    proc, url = start_simulator(sim_dir, sim_args(None), name="sim-default")
    try:
        simulated = limits(url)
    finally:
        proc.stop()
    assert simulated == limits(real_sglang.url)


def test_health_during_the_start_up(real_sglang_context: RealServer, sim_dir: Path) -> None:
    # The real server's start-up was watched by the fixture's launcher; a fresh simulator
    # that takes a while to start is polled the same way.
    proc, url = start_simulator(sim_dir, [*sim_args(REAL_CONTEXT_LENGTH), "--startup-s", "2"],
                                name="sim-starting")
    codes: list[int] = []
    try:
        sglang.wait_healthy(url, proc.alive, proc.log_path, timeout_s=60, codes=codes)
        empty = requests.get(f"{url}/health", timeout=30).content
    finally:
        proc.stop()
    assert codes == real_sglang_context.health_codes == [503, 200]
    assert empty == b""


# --- /generate ------------------------------------------------------------------------------

def test_a_normal_request(pair: list[Target]) -> None:
    def scenario(t: Target) -> dict:
        rid = rid_of("normal")
        body = t.post({"input_ids": [1, 5, 6, 7], "rid": rid,
                       "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
        return {**shape(body), "id": body["meta_info"]["id"] == rid}
    real, simulated = both(pair, scenario)
    assert simulated == real
    assert real["finish_reason"] == {"type": "length", "length": 8}


def test_a_streamed_request_s_first_and_final_chunks(pair: list[Target]) -> None:
    def scenario(t: Target) -> dict:
        resp = requests.post(f"{t.url}/generate", stream=True, timeout=TIMEOUT, json={
            "input_ids": [1, 5, 6, 7], "stream": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        lines = [line for line in resp.iter_lines() if line]
        chunks = [json.loads(line.removeprefix(b"data: ")) for line in lines[:-1]]
        return {"done": lines[-1], "type": resp.headers["Content-Type"].split(";")[0],
                "first": sorted(chunks[0]["meta_info"]), "final": shape(chunks[-1])}
    real, simulated = both(pair, scenario)
    assert simulated == real


@pytest.mark.parametrize("length, max_new", [
    (LIMIT, 1),  # input >= max_req_input_len (protocol branch)
    (LIMIT - 1, 1),  # served
    (REAL_CONTEXT_LENGTH, 1),  # input >= the context
    (REAL_CONTEXT_LENGTH - 16, 15),  # served, the scheduler lowers max_new_tokens to 14
    (REAL_CONTEXT_LENGTH - 16, 16),  # input + max_new_tokens == context: served (protocol)
    (REAL_CONTEXT_LENGTH - 16, 17),  # one more: refused
])
def test_the_length_rules(pair: list[Target], length: int, max_new: int) -> None:
    def scenario(t: Target) -> tuple[int, Any]:
        resp = t.post({"input_ids": prompt(length), "sampling_params": {
            "max_new_tokens": max_new}})
        return (resp.status_code, shape(resp.json())) if resp.ok else answer(resp)
    real, simulated = both(pair, scenario)
    assert simulated == real


def test_an_unknown_sampling_param(pair: list[Target]) -> None:
    real, simulated = both(pair, lambda t: answer(t.post({
        "input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2, "bogus": 1}})))
    assert simulated == real
    assert real[0] == 400


def test_a_duplicate_rid_in_flight(pair: list[Target]) -> None:
    def scenario(t: Target) -> tuple[int, Any]:
        rid = rid_of("dup")
        thread, _ = in_flight(t, rid, 2000)
        again = t.post({"input_ids": [1, 5], "rid": rid,
                        "sampling_params": {"max_new_tokens": 2}})
        requests.post(f"{t.url}/abort_request", json={"rid": rid}, timeout=30)
        thread.join(120)
        return answer(again, rid)
    real, simulated = both(pair, scenario)
    assert simulated == real
    assert real == (400, {"error": {"message": "Duplicate request ID detected: <rid>"}})


def test_an_abort_by_the_exact_rid(pair: list[Target]) -> None:
    # Streamed, so that a token out shows the request is decoding on both before the abort
    # (an abort that meets its request still in the waiting queue is the next test).
    def scenario(t: Target) -> dict:
        rid, cap = rid_of("abort"), 2000
        resp = requests.post(f"{t.url}/generate", stream=True, timeout=TIMEOUT, json={
            "input_ids": prompt(8), "rid": rid, "stream": True,
            "sampling_params": {"max_new_tokens": cap, "temperature": 0}})
        lines = (line for line in resp.iter_lines() if line)
        first = next(lines)
        aborted = requests.post(f"{t.url}/abort_request", json={"rid": rid}, timeout=30)
        rest = [line for line in lines if line != b"data: [DONE]"]
        final = json.loads((rest or [first])[-1].removeprefix(b"data: "))
        meta = final["meta_info"]
        return {"abort_answer": (aborted.status_code, aborted.content),
                "status": resp.status_code, "finish_reason": meta["finish_reason"],
                "meta_keys": sorted(meta),
                "partial": 0 < len(final["output_ids"]) == meta["completion_tokens"] < cap}
    real, simulated = both(pair, scenario)
    assert simulated == real
    assert real["partial"] and real["finish_reason"] == {
        "type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def queued_abort_on_sglang(t: Target) -> dict:
    """An abort that meets its request in SGLang's waiting queue. Only an abort that reaches
    the scheduler in the same receive as its request does: other requests' long prefills keep
    the scheduler busy meanwhile, and the attempt is repeated until one does (a few tries on
    2 cores; each attempt that was decoding is aborted after a token or none)."""
    stop = threading.Event()
    long_prefill = {"input_ids": [1] + [(7 * i) % 4000 + 10 for i in range(3000)],
                    "sampling_params": {"max_new_tokens": 1}}

    def busy() -> None:
        while not stop.is_set():
            t.post(long_prefill)
    workers = [threading.Thread(target=busy, daemon=True) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        for _ in range(QUEUED_ABORT_TRIES):
            rid = rid_of("queued")
            thread, out = in_flight(t, rid, 300)
            requests.post(f"{t.url}/abort_request", json={"rid": rid}, timeout=30)
            thread.join(300)
            reason = out["resp"].json()["meta_info"]["finish_reason"]
            if reason.get("message") == "Abort in waiting queue":
                return abort_shape(out["resp"])
        pytest.fail(f"no abort met its request in the waiting queue in {QUEUED_ABORT_TRIES} "
                    "tries")
    finally:
        stop.set()
        for w in workers:
            w.join(300)


def queued_abort_on_the_simulator(url: str) -> dict:
    """The same on a simulator whose one batch slot is taken: the request waits for it."""
    t = Target("simulator-1-slot", url, sim_started(url))
    holder, _ = in_flight(t, rid_of("holder"), 2000)
    rid = rid_of("queued")
    thread, out = in_flight(t, rid, 300)
    requests.post(f"{url}/abort_request", json={"rid": rid}, timeout=30)
    thread.join(60)
    requests.post(f"{url}/abort_request", json={"abort_all": True}, timeout=30)
    holder.join(60)
    return abort_shape(out["resp"])


def abort_shape(resp: requests.Response) -> dict:
    body = resp.json()
    meta = body["meta_info"]
    return {"status": resp.status_code, "keys": sorted(body), "meta_keys": list(meta),
            "finish_reason": meta["finish_reason"], "text": body["text"],
            "outputs": body["output_ids"], "completion_tokens": meta["completion_tokens"],
            "weight_versions": meta["weight_versions"]}


def test_an_abort_that_meets_its_request_in_the_waiting_queue(
        pair: list[Target], sim_dir: Path) -> None:
    real = queued_abort_on_sglang(pair[0])
    proc, url = start_simulator(sim_dir, sim_args(REAL_CONTEXT_LENGTH)
                                + ["--max-running-requests", "1"], name="sim-one-slot")
    try:
        simulated = queued_abort_on_the_simulator(url)
    finally:
        proc.stop()
    assert simulated == real
    assert real["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert real["outputs"] == [] and real["completion_tokens"] == 0


def test_an_abort_by_a_rid_prefix(pair: list[Target]) -> None:
    # depends on the protocol branch: the simulator aborts by exact rid by default
    def scenario(t: Target) -> dict:
        rid, cap = rid_of("prefix"), 48
        thread, out = in_flight(t, rid, cap)
        answered = requests.post(f"{t.url}/abort_request", json={"rid": rid[:-4]}, timeout=30)
        thread.join(300)
        return {"abort_answer": answered.status_code,
                "finish_reason": out["resp"].json()["meta_info"]["finish_reason"]}
    real, simulated = both(pair, scenario)
    assert simulated == real
    assert real["finish_reason"] == {"type": "length", "length": 48}


def test_an_abort_of_an_unknown_rid(pair: list[Target]) -> None:
    def scenario(t: Target) -> tuple[int, bytes]:
        resp = requests.post(f"{t.url}/abort_request", json={"rid": rid_of("nobody")},
                             timeout=30)
        return resp.status_code, resp.content
    real, simulated = both(pair, scenario)
    assert simulated == real == (200, b"")


def test_a_stop_on_a_token_the_answer_makes(pair: list[Target]) -> None:
    def scenario(t: Target) -> dict:
        body = {"input_ids": [1, 9, 10, 11], "sampling_params": {"max_new_tokens": 12,
                                                                   "temperature": 0}}
        free = t.post(body).json()["output_ids"]
        stop_id = free[4]
        stopped = t.post({**body, "sampling_params": {**body["sampling_params"],
                                                      "stop_token_ids": [stop_id]}}).json()
        reason = stopped["meta_info"]["finish_reason"]
        return {"reason_keys": sorted(reason), "type": reason["type"],
                "matched_is_the_stop_id": reason["matched"] == stop_id,
                "ends_with_it": stopped["output_ids"][-1] == stop_id,
                "prefix_of_the_free_answer": stopped["output_ids"] == free[:len(
                    stopped["output_ids"])],
                "meta_keys": sorted(stopped["meta_info"])}
    real, simulated = both(pair, scenario)
    assert simulated == real
    assert real["type"] == "stop" and real["ends_with_it"]


@pytest.mark.parametrize("rid", ["list", "string", "duplicate", "none"])
def test_a_batch(pair: list[Target], rid: str) -> None:
    def scenario(t: Target) -> tuple[int, Any]:
        base = rid_of("batch")
        rids = {"list": [base + "-a", base + "-b"], "string": base,
                "duplicate": [base, base], "none": None}[rid]
        resp = t.post({"input_ids": [[1, 5, 6], [1, 7, 8, 9]], "rid": rids,
                       "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
        if not resp.ok:
            return answer(resp, base)
        items = resp.json()
        ids = [i["meta_info"]["id"].replace(base, "<rid>") for i in items]
        return resp.status_code, ([shape(i) for i in items],
                                  ids if rid != "none" else len(set(ids)))
    real, simulated = both(pair, scenario)
    assert simulated == real


@pytest.mark.parametrize("body", [
    {"sampling_params": {"max_new_tokens": 2}},  # no input
    {"input_ids": [], "sampling_params": {"max_new_tokens": 2}},
    {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": "2"}},  # schema: type
    {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2, "temperature": -1}},
    {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}},
    {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 0}},
    {"input_ids": [1, 5], "unknown_top_level_key": 1, "sampling_params": {"max_new_tokens": 2}},
], ids=["no-input", "empty-input", "wrong-type", "negative-temperature", "min-over-max",
        "zero-new-tokens", "unknown-top-level-key"])
def test_other_requests_the_pipeline_could_send(pair: list[Target], body: dict) -> None:
    def scenario(t: Target) -> tuple[int, Any]:
        resp = t.post(body)
        return (resp.status_code, shape(resp.json())) if resp.ok else answer(resp)
    real, simulated = both(pair, scenario)
    assert simulated == real
