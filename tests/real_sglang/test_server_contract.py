"""The SGLang contract the pipeline relies on, checked against a real SGLang 0.5.23 server."""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import pytest
import requests
from conftest import REAL_CONTEXT_LENGTH, wait_until
from sglang_fixture import RealServer

from datagen.client import SGLangClient
from datagen.errors import BadRequest, PermanentError


def test_a_default_launched_server_reports_no_context_length_but_its_limits(
        real_sglang: RealServer) -> None:
    info = requests.get(f"{real_sglang.url}/server_info", timeout=30).json()
    assert info["version"] == "0.5.23"
    assert info["context_length"] is None
    models = requests.get(f"{real_sglang.url}/v1/models", timeout=30).json()
    context = models["data"][0]["max_model_len"]
    assert context == 32768  # the tiny model's max_position_embeddings
    assert info["max_req_input_len"] == context - 6


def test_health_answers_503_while_the_server_starts_then_200(
        real_sglang_context: RealServer) -> None:
    # The port listens before the model is loaded; /health says so with 503.
    assert real_sglang_context.health_codes[-1] == 200
    assert 503 in real_sglang_context.health_codes, real_sglang_context.health_codes


def test_generate_with_input_ids_and_a_rid_answers_the_output_ids(
        real_sglang: RealServer) -> None:
    resp = requests.post(f"{real_sglang.url}/generate", timeout=120, json={
        "input_ids": [1, 5, 6, 7], "rid": "contract-smoke",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert len(body["output_ids"]) == 8
    assert body["meta_info"]["id"] == "contract-smoke"
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


# --- helpers -------------------------------------------------------------------------------

TIMEOUT = (10, 300)
# Token ids the tiny tokenizer has (vocab 4096): SGLang 0.5.23 does not check input_ids
# against the vocabulary, and an id past it crashes the whole server (the embedding lookup
# raises in the scheduler), so every prompt here stays inside it.
FILL = 5


def post(server: RealServer, body: dict) -> requests.Response:
    return requests.post(f"{server.url}/generate", json=body, timeout=TIMEOUT)


def prompt(length: int) -> list[int]:
    return [1] + [FILL] * (length - 1)


def in_background(fn: Any, *args: Any) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        out["result"] = fn(*args)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def unique(name: str) -> str:
    # rids must not collide with other runs' on a server kept between pytest runs
    return f"contract-{name}-{uuid.uuid4().hex[:8]}"


def long_request(server: RealServer, rid: str, cap: int) -> tuple[threading.Thread, dict]:
    """A /generate of ``cap`` tokens in a thread, returned once the server logged it."""
    thread, out = in_background(post, server, {
        "input_ids": prompt(8), "rid": rid,
        "sampling_params": {"max_new_tokens": cap, "temperature": 0}})
    wait_until(lambda: server.logged("request.received", rid) or "result" in out,
               timeout_s=120, what=f"the server to log {rid}")
    return thread, out


# --- the limits a default and a --context-length launch report -----------------------------

def test_a_context_length_launch_reports_it_and_the_limits_follow(
        real_sglang_context: RealServer) -> None:
    info = requests.get(f"{real_sglang_context.url}/server_info", timeout=30).json()
    models = requests.get(f"{real_sglang_context.url}/v1/models", timeout=30).json()
    assert info["context_length"] == REAL_CONTEXT_LENGTH
    assert info["max_req_input_len"] == REAL_CONTEXT_LENGTH - 6
    assert models["data"][0]["max_model_len"] == REAL_CONTEXT_LENGTH


# --- the three length rules (context 4096, so max_req_input_len 4090) -----------------------

def test_an_input_of_max_req_input_len_tokens_is_refused_one_less_is_served(
        real_sglang_context: RealServer) -> None:
    limit = REAL_CONTEXT_LENGTH - 6
    refused = post(real_sglang_context, {"input_ids": prompt(limit),
                                         "sampling_params": {"max_new_tokens": 1}})
    served = post(real_sglang_context, {"input_ids": prompt(limit - 1),
                                        "sampling_params": {"max_new_tokens": 1}})
    assert refused.status_code == 400
    assert refused.json() == {"error": {"message": (
        f"Input length ({limit} tokens) exceeds the maximum allowed length ({limit} tokens). "
        "Use a shorter input or enable --allow-auto-truncate.")}}
    assert served.status_code == 200, served.text
    assert served.json()["meta_info"]["prompt_tokens"] == limit - 1


def test_an_input_of_the_context_length_is_refused_as_longer_than_the_context(
        real_sglang_context: RealServer) -> None:
    resp = post(real_sglang_context, {"input_ids": prompt(REAL_CONTEXT_LENGTH),
                                      "sampling_params": {"max_new_tokens": 1}})
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": (
        f"The input ({REAL_CONTEXT_LENGTH} tokens) is longer than the model's context length "
        f"({REAL_CONTEXT_LENGTH} tokens).")}}


def test_input_plus_max_new_tokens_may_fill_the_context_but_not_exceed_it(
        real_sglang_context: RealServer) -> None:
    length, room = REAL_CONTEXT_LENGTH - 16, 16
    full = post(real_sglang_context, {"input_ids": prompt(length),
                                      "sampling_params": {"max_new_tokens": room}})
    over = post(real_sglang_context, {"input_ids": prompt(length),
                                      "sampling_params": {"max_new_tokens": room + 1}})
    assert full.status_code == 200, full.text
    # served, but the scheduler lowers max_new_tokens to max_req_len - input - 1 (context - 1
    # - input - 1): two tokens short of the context, finish_reason length all the same
    assert full.json()["meta_info"]["finish_reason"] == {"type": "length", "length": room - 2}
    assert len(full.json()["output_ids"]) == room - 2
    assert over.status_code == 400
    assert over.json() == {"error": {"message": (
        f"Requested token count exceeds the model's maximum context length of "
        f"{REAL_CONTEXT_LENGTH} tokens. You requested a total of {REAL_CONTEXT_LENGTH + 1} "
        f"tokens: {length} tokens from the input messages and {room + 1} tokens for the "
        "completion. Please reduce the number of tokens in the input messages or the "
        "completion to fit within the limit.")}}


# --- /generate: finish reasons, abort, rids, sampling keys, batches -------------------------

def test_stop_token_ids_end_the_output_with_the_matched_id(
        real_sglang_context: RealServer) -> None:
    # Given: the greedy answer to a prompt, and a token it makes after a few others
    body = {"input_ids": [1, 9, 10, 11], "sampling_params": {"max_new_tokens": 12,
                                                               "temperature": 0}}
    free = post(real_sglang_context, body).json()["output_ids"]
    stop_id = free[4]
    # When: the same request stops on that token
    stopped = post(real_sglang_context, {**body, "sampling_params": {
        **body["sampling_params"], "stop_token_ids": [stop_id]}}).json()
    # Then: the output ends with it, the matched id is named, nothing after it was kept
    upto = free.index(stop_id) + 1
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert stopped["output_ids"] == free[:upto]
    assert stopped["meta_info"]["completion_tokens"] == upto


def test_an_abort_by_the_exact_rid_answers_200_with_the_partial_output(
        real_sglang_context: RealServer) -> None:
    # The request log says the tokenizer manager has the request, not that the scheduler runs
    # it: an abort that reaches the scheduler in the same receive finds it still waiting, and
    # SGLang then answers it unrun (seen in a loaded CI run). Both answers are SGLang's; the
    # pipeline discards either (tests/real_sglang/test_simulator_matches_sglang.py holds each
    # beside the simulator).
    rid, cap = unique("abort"), 2000
    thread, out = long_request(real_sglang_context, rid, cap)
    aborted = requests.post(f"{real_sglang_context.url}/abort_request", json={"rid": rid},
                            timeout=30)
    thread.join(120)
    assert (aborted.status_code, aborted.content) == (200, b"")
    resp = out["result"]
    assert resp.status_code == 200
    body = resp.json()
    meta = body["meta_info"]
    assert len(body["output_ids"]) == meta["completion_tokens"] < cap
    if meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}:
        assert body["output_ids"] == [] and "prompt_tokens" not in meta
    else:
        assert meta["finish_reason"] == {"type": "abort", "message": "Aborted",
                                         "status_code": None, "err_type": None}
        assert meta["prompt_tokens"] == 8


def test_an_aborted_stream_keeps_the_tokens_made_before_the_abort(
        real_sglang_context: RealServer) -> None:
    rid = unique("abort-stream")
    # ignore_eos: the tiny random model may sample its eos before the abort lands ('stop')
    resp = requests.post(f"{real_sglang_context.url}/generate", stream=True, timeout=TIMEOUT,
                         json={"input_ids": prompt(8), "rid": rid, "stream": True,
                               "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}})
    lines = resp.iter_lines()
    first = next(line for line in lines if line)  # a token is out: the request is decoding
    requests.post(f"{real_sglang_context.url}/abort_request", json={"rid": rid}, timeout=30)
    chunks = [json.loads(first.removeprefix(b"data: "))] + [
        json.loads(line.removeprefix(b"data: ")) for line in lines
        if line and line != b"data: [DONE]"]
    final = chunks[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert 1 <= len(final["output_ids"]) < 2000
    # the output is cumulative, and the first chunk may already hold more than one token
    assert final["output_ids"][:len(chunks[0]["output_ids"])] == chunks[0]["output_ids"]
    assert final["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted",
                                                   "status_code": None, "err_type": None}


def test_an_abort_by_a_rid_prefix_aborts_nothing(real_sglang_context: RealServer) -> None:
    # SGLang 0.5.23's tokenizer manager (--tokenizer-worker-num 1, the default) looks the
    # rid up exactly and drops one it does not run: the prefix never reaches the scheduler.
    # Streamed, so that the request is seen decoding before the abort and well after it
    # (the scheduler takes its messages before every step).
    rid, after = unique("prefix"), 8
    resp = requests.post(f"{real_sglang_context.url}/generate", stream=True, timeout=TIMEOUT,
                         json={"input_ids": prompt(8), "rid": rid, "stream": True,
                               "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}})
    chunks = (json.loads(line.removeprefix(b"data: ")) for line in resp.iter_lines()
              if line and line != b"data: [DONE]")
    first = next(chunks)
    answer = requests.post(f"{real_sglang_context.url}/abort_request",
                           json={"rid": rid[:-4]}, timeout=30)
    at_abort, final, stopped = len(first["output_ids"]), first, False
    for final in chunks:
        if not stopped and len(final["output_ids"]) >= at_abort + after:
            stopped = requests.post(f"{real_sglang_context.url}/abort_request",
                                    json={"rid": rid}, timeout=30).ok
    assert answer.status_code == 200 and stopped
    # it decoded on past the prefix abort until the exact one stopped it
    assert final["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted",
                                                   "status_code": None, "err_type": None}
    assert at_abort + after <= len(final["output_ids"]) < 2000


def test_a_rid_already_in_flight_is_refused_as_a_duplicate(
        real_sglang_context: RealServer) -> None:
    rid = unique("dup")
    thread, _ = long_request(real_sglang_context, rid, 2000)
    again = post(real_sglang_context, {"input_ids": [1, 5], "rid": rid,
                                       "sampling_params": {"max_new_tokens": 2}})
    requests.post(f"{real_sglang_context.url}/abort_request", json={"rid": rid}, timeout=30)
    thread.join(120)
    assert again.status_code == 400
    assert again.json() == {"error": {"message": f"Duplicate request ID detected: {rid}"}}


def test_an_unknown_sampling_param_is_refused_with_the_schemas_own_text(
        real_sglang_context: RealServer) -> None:
    resp = post(real_sglang_context, {"input_ids": [1, 5], "sampling_params": {
        "max_new_tokens": 2, "max_tokens": 2}})
    assert resp.status_code == 400
    # the schema decoder's text is the whole error value, not {"message": ...}
    error = resp.json()["error"]
    assert error.startswith("unknown field `max_tokens`, expected one of `max_new_tokens`, ")
    assert error.endswith("`beam_width`, `watermark`, `choice`")


def test_a_batch_answers_one_result_per_prompt_in_order(
        real_sglang_context: RealServer) -> None:
    resp = post(real_sglang_context, {"input_ids": [[1, 5, 6], [1, 7, 8, 9]],
                                      "rid": [unique("b0"), unique("b1")],
                                      "sampling_params": {"max_new_tokens": 3,
                                                          "temperature": 0}})
    assert resp.status_code == 200
    body = resp.json()
    assert isinstance(body, list) and len(body) == 2
    assert [b["meta_info"]["prompt_tokens"] for b in body] == [3, 4]
    assert all(len(b["output_ids"]) == 3 for b in body)
    assert all(b["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
               for b in body)


# --- a 400 reaches the pipeline with the server's own words --------------------------------

def test_the_clients_bad_request_carries_the_servers_message(
        real_sglang_context: RealServer) -> None:
    client = SGLangClient(real_sglang_context.url)
    with pytest.raises(BadRequest) as refused:
        client.generate(prompt(REAL_CONTEXT_LENGTH - 16), {"max_new_tokens": 17},
                        rid=unique("client"))
    assert isinstance(refused.value, PermanentError)
    assert str(refused.value) == (
        f"Requested token count exceeds the model's maximum context length of "
        f"{REAL_CONTEXT_LENGTH} tokens. You requested a total of {REAL_CONTEXT_LENGTH + 1} "
        f"tokens: {REAL_CONTEXT_LENGTH - 16} tokens from the input messages and 17 tokens "
        "for the completion. Please reduce the number of tokens in the input messages or the "
        "completion to fit within the limit.")
    with pytest.raises(BadRequest, match=r"^unknown field `bogus`, expected one of "):
        client.generate([1, 5], {"max_new_tokens": 2, "bogus": 1}, rid=unique("client"))
