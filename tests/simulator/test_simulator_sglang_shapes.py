"""Answers the simulator gives in SGLang 0.5.23's exact shape and words (measured on a real
server: tests/real_sglang/test_simulator_matches_sglang.py compares the two side by side)."""

import json

import pytest
import requests
from simharness import (
    TIMEOUT,
    generate,
    in_background,
    running_sim,
    stats,
    wait_until,
)

# SGLang 0.5.23's meta_info keys, in its order, of a whole (non-stream) answer.
WHOLE_KEYS = ["id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
              "reasoning_tokens", "completion_tokens", "cached_tokens", "weight_versions",
              "cached_tokens_details", "dp_rank", "e2e_latency", "response_sent_to_client_ts"]


def test_meta_info_has_sglangs_keys_whole_and_streamed():
    with running_sim(lengths="fixed:5") as url:
        whole = generate(url, sampling_params={"max_new_tokens": 9}).json()
        resp = requests.post(f"{url}/generate", stream=True, timeout=TIMEOUT, json={
            "input_ids": [11, 12, 13], "stream": True, "sampling_params": {"max_new_tokens": 9}})
        chunks = [json.loads(line.removeprefix(b"data: ")) for line in resp.iter_lines()
                  if line and line != b"data: [DONE]"]
    assert list(whole["meta_info"]) == WHOLE_KEYS
    assert whole["meta_info"]["weight_versions"] == [{"version": "default", "start": 0,
                                                      "end": 5}]
    first, middle, final = chunks[0]["meta_info"], chunks[1]["meta_info"], chunks[-1]["meta_info"]
    no_finish = {"weight_versions", "e2e_latency"}
    assert list(first) == [k for k in WHOLE_KEYS if k not in no_finish]
    assert list(middle) == [k for k in WHOLE_KEYS
                            if k not in no_finish | {"response_sent_to_client_ts"}]
    assert list(final) == [k for k in WHOLE_KEYS if k != "response_sent_to_client_ts"]


def test_stop_token_ids_end_the_output_with_the_matched_id():
    with running_sim(lengths="fixed:40") as url:
        free = generate(url, sampling_params={"max_new_tokens": 30}).json()["output_ids"]
        stop_id = free[6]
        cut = generate(url, sampling_params={"max_new_tokens": 30,
                                             "stop_token_ids": [stop_id]}).json()
        late = generate(url, sampling_params={"max_new_tokens": 30, "stop_token_ids": [stop_id],
                                              "min_new_tokens": 7}).json()
    upto = free.index(stop_id) + 1
    assert cut["output_ids"] == free[:upto]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert cut["meta_info"]["completion_tokens"] == upto
    # min_new_tokens keeps a stop id from ending the output before it
    if stop_id not in free[7:]:
        assert late["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    else:
        assert late["output_ids"][-1] == stop_id and len(late["output_ids"]) > 7


def test_health_answers_503_during_the_start_up_then_200():
    with running_sim(startup_s=60.0) as url:
        starting = requests.get(f"{url}/health", timeout=TIMEOUT)
        starting_generate = requests.get(f"{url}/health_generate", timeout=TIMEOUT)
    with running_sim(startup_s=0.3) as url:
        wait_until(lambda: requests.get(f"{url}/health", timeout=TIMEOUT).status_code == 200)
    assert (starting.status_code, starting.content) == (503, b"")
    assert starting_generate.status_code == 503


def test_batch_rids_duplicates_and_missing_inputs_in_sglangs_words():
    with running_sim() as url:
        named = requests.post(f"{url}/generate", timeout=TIMEOUT, json={
            "input_ids": [[1, 5], [1, 6]], "rid": "x", "sampling_params": {"max_new_tokens": 2}})
        twice = requests.post(f"{url}/generate", timeout=TIMEOUT, json={
            "input_ids": [[1, 5], [1, 6]], "rid": ["bd", "bd"]})
        nothing = requests.post(f"{url}/generate", json={"sampling_params": {}}, timeout=TIMEOUT)
        empty = generate(url, [])
        both = requests.post(f"{url}/generate", timeout=TIMEOUT, json={
            "text": "a b c d e", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        wrong_type = generate(url, sampling_params={"max_new_tokens": "3"})
    assert [b["meta_info"]["id"] for b in named.json()] == ["x_0", "x_1"]
    assert twice.status_code == 400
    assert twice.json() == {"error": {
        "message": "Duplicate request IDs detected within the request: ['bd']"}}
    assert nothing.json() == {"error": {
        "message": "Either text, input_ids or input_embeds should be provided."}}
    assert empty.json() == {"error": {"message": "input_ids cannot be empty."}}
    assert both.status_code == 200 and both.json()["meta_info"]["prompt_tokens"] == 2
    assert wrong_type.json() == {"error": 'invalid type: string "3", expected i64'}


def test_an_aborted_request_answers_sglangs_abort_reason():
    with running_sim(time_scale=0.05, lengths="fixed:2000") as url:
        thread, out = in_background(generate, url, rid="to-abort",
                                    sampling_params={"max_new_tokens": 5000})
        wait_until(lambda: stats(url)["tokens_generated"] >= 5)
        requests.post(f"{url}/abort_request", json={"rid": "to-abort"}, timeout=TIMEOUT)
        thread.join(10)
    assert out["result"].json()["meta_info"]["finish_reason"] == {
        "type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_aborted_in_the_waiting_queue_answers_as_sglangs_tokenizer_manager(
        stream: bool) -> None:
    # Seen on the real server (an abort that reached the scheduler beside its request): the
    # scheduler hands the request back unrun, and the tokenizer manager answers it alone.
    with running_sim(time_scale=0.05, lengths="fixed:2000", max_running_requests=1) as url:
        running, _ = in_background(generate, url, rid="running",
                                   sampling_params={"max_new_tokens": 5000})
        wait_until(lambda: stats(url)["tokens_generated"] >= 5)
        thread, out = in_background(generate, url, rid="queued", stream=stream,
                                    sampling_params={"max_new_tokens": 5000})
        wait_until(lambda: stats(url)["waiting"] == 1)
        requests.post(f"{url}/abort_request", json={"rid": "queued"}, timeout=TIMEOUT)
        thread.join(10)
        still = stats(url)["running"]
        requests.post(f"{url}/abort_request", json={"rid": "running"}, timeout=TIMEOUT)
        running.join(10)
    resp = out["result"]
    events = [line for line in resp.text.splitlines() if line.startswith("data: ")]
    body = json.loads(events[0].removeprefix("data: ")) if stream else resp.json()
    assert resp.status_code == 200 and still == 1
    if stream:
        assert events[1:] == ["data: [DONE]"]  # one chunk: the abort
    meta = body.pop("meta_info")
    assert body == {"text": "", "output_ids": []}
    assert list(meta) == ["id", "finish_reason", "weight_version", "e2e_latency",
                          "weight_versions", "completion_tokens", "response_sent_to_client_ts"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert meta["completion_tokens"] == 0 and meta["id"] == "queued"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 0}]


def test_max_new_tokens_is_lowered_to_what_the_scheduler_has_room_for():
    # Context 100: max_req_len 99, so an input of 80 gets at most 99 - 80 - 1 = 18 tokens.
    with running_sim(context_length=100, lengths="fixed:1000") as url:
        capped = generate(url, list(range(3, 83)), sampling_params={"max_new_tokens": 19})
        fits = generate(url, list(range(3, 83)), sampling_params={"max_new_tokens": 18})
    assert capped.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 18}
    assert len(capped.json()["output_ids"]) == 18
    assert fits.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 18}
