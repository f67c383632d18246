"""The SGLang /generate protocol as the simulator speaks it, over real HTTP on loopback."""

import hashlib
import json

import requests
from simharness import TIMEOUT, generate, in_background, log, running_sim, stats, wait_until

# Slow enough that a request with 2,000 tokens stays in flight for seconds: room to abort it.
SLOW = {"time_scale": 0.05, "lengths": "fixed:2000"}
LONG = {"max_new_tokens": 5000}


def test_generate_answers_in_sglang_shape_and_repeats_itself():
    with running_sim(lengths="fixed:16") as url:
        first = generate(url, sampling_params={"max_new_tokens": 64})
        second = generate(url, sampling_params={"max_new_tokens": 64, "temperature": 0.7})
    assert first.status_code == 200
    body = first.json()
    meta = body["meta_info"]
    assert set(meta) >= {"id", "finish_reason", "prompt_tokens", "completion_tokens",
                         "cached_tokens", "e2e_latency"}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 16
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert len(body["output_ids"]) == 16 and body["output_ids"][-1] == 2
    assert 2 not in body["output_ids"][:-1]
    assert body["text"].startswith("tok")
    assert second.json()["output_ids"] == body["output_ids"]


def test_max_new_tokens_caps_the_output_with_finish_length():
    with running_sim(lengths="fixed:50") as url:
        capped = generate(url, sampling_params={"max_new_tokens": 20}).json()
        free = generate(url, sampling_params={"max_new_tokens": 100}).json()
    assert capped["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert capped["output_ids"] == free["output_ids"][:20]
    assert 2 not in capped["output_ids"]
    assert free["meta_info"]["completion_tokens"] == 50


def test_text_input_and_batches_work():
    with running_sim() as url:
        single = requests.post(f"{url}/generate", json={"text": "hello simulated world"},
                               timeout=TIMEOUT).json()
        batch = requests.post(f"{url}/generate", timeout=TIMEOUT, json={
            "input_ids": [[1, 2, 3], [4, 5]], "rid": ["batch-a", "batch-b"],
        }).json()
    assert single["meta_info"]["prompt_tokens"] == 3
    assert [item["meta_info"]["id"] for item in batch] == ["batch-a", "batch-b"]
    assert [item["meta_info"]["prompt_tokens"] for item in batch] == [3, 2]


def _stream(url: str, **fields: object) -> list[str]:
    resp = requests.post(f"{url}/generate", json={"input_ids": [7, 8, 9], "stream": True,
                                                  **fields}, stream=True, timeout=TIMEOUT)
    assert resp.status_code == 200
    assert resp.headers["Content-Type"] == "text/event-stream"
    return [line.decode() for line in resp.iter_lines() if line]


def test_stream_sends_cumulative_chunks_then_done():
    with running_sim(lengths="fixed:12") as url:
        lines = _stream(url, sampling_params={"max_new_tokens": 100})
        whole = generate(url, [7, 8, 9], sampling_params={"max_new_tokens": 100}).json()
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 13))
    for earlier, later in zip(chunks, chunks[1:], strict=False):
        assert later["output_ids"][: len(earlier["output_ids"])] == earlier["output_ids"]
        assert earlier["meta_info"]["finish_reason"] is None
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert chunks[-1]["output_ids"] == whole["output_ids"]


def test_stream_interval_follows_sglang_rule():
    # SGLang sends at lengths 1, 1+k, 1+2k, ... for stream_interval k > 1, plus the final one.
    with running_sim(lengths="fixed:12") as url:
        lines = _stream(url, sampling_params={"max_new_tokens": 100, "stream_interval": 5})
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 6, 11, 12]


def test_abort_matches_the_rid_exactly_and_returns_partial_output():
    # SGLang 0.5.23 with its default --tokenizer-worker-num 1 looks the rid up exactly: a
    # prefix of running rids aborts nothing (and answers 200 all the same).
    with running_sim(**SLOW) as url:
        calls = {rid: in_background(generate, url, [i + 1], rid=rid, sampling_params=LONG)
                 for i, rid in enumerate(["job1-aaaa", "job1-bbbb", "job2-cccc"])}
        wait_until(lambda: stats(url)["tokens_generated"] >= 30)
        prefix = requests.post(f"{url}/abort_request", json={"rid": "job1-"}, timeout=TIMEOUT)
        assert prefix.status_code == 200 and stats(url)["running"] == 3
        assert requests.post(f"{url}/abort_request", json={"rid": "job1-aaaa"},
                             timeout=TIMEOUT).status_code == 200
        thread, out = calls["job1-aaaa"]
        thread.join(10)
        body = out["result"].json()
        assert out["result"].status_code == 200
        assert body["meta_info"]["finish_reason"] == {
            "type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        assert 0 < len(body["output_ids"]) < 2000
        assert body["meta_info"]["completion_tokens"] == len(body["output_ids"])
        assert stats(url)["running"] == 2  # job1-bbbb and job2-cccc run on
        requests.post(f"{url}/abort_request", json={"abort_all": True}, timeout=TIMEOUT)
        for thread, _ in calls.values():
            thread.join(10)
        aborted = [r["rid"] for r in log(url) if r["event"] == "abort"]
    assert aborted[0] == "job1-aaaa" and sorted(aborted[1:]) == ["job1-bbbb", "job2-cccc"]


def test_abort_by_prefix_emulates_two_tokenizer_workers():
    # --tokenizer-worker-num 2: the rid reaches the scheduler, which matches it as a prefix.
    with running_sim(abort_by_prefix=True, **SLOW) as url:
        calls = {rid: in_background(generate, url, [i + 1], rid=rid, sampling_params=LONG)
                 for i, rid in enumerate(["job1-aaaa", "job1-bbbb", "job2-cccc"])}
        wait_until(lambda: stats(url)["tokens_generated"] >= 30)
        requests.post(f"{url}/abort_request", json={"rid": "job1-"}, timeout=TIMEOUT)
        for rid in ("job1-aaaa", "job1-bbbb"):
            calls[rid][0].join(10)
            assert calls[rid][1]["result"].json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert stats(url)["running"] == 1  # job2-cccc was not a prefix match
        requests.post(f"{url}/abort_request", json={"abort_all": True}, timeout=TIMEOUT)
        calls["job2-cccc"][0].join(10)


def test_abort_all_also_aborts_waiting_requests():
    with running_sim(max_running_requests=1, **SLOW) as url:
        calls = [in_background(generate, url, [i + 1], rid=f"r{i}", sampling_params=LONG)
                 for i in range(3)]
        wait_until(lambda: (s := stats(url))["waiting"] == 2 and s["tokens_generated"] > 0)
        requests.post(f"{url}/abort_request", json={"abort_all": True}, timeout=TIMEOUT)
        bodies = []
        for thread, out in calls:
            thread.join(10)
            bodies.append(out["result"].json())
    assert all(b["meta_info"]["finish_reason"]["type"] == "abort" for b in bodies)
    assert sorted(b["meta_info"]["completion_tokens"] == 0 for b in bodies) == [False, True, True]


def test_abort_of_unknown_rid_is_200_with_empty_body():
    with running_sim() as url:
        resp = requests.post(f"{url}/abort_request", json={"rid": "nobody"}, timeout=TIMEOUT)
    assert resp.status_code == 200 and resp.content == b""


def test_duplicate_in_flight_rid_is_400():
    with running_sim(**SLOW) as url:
        thread, _ = in_background(generate, url, rid="same-rid", sampling_params=LONG)
        wait_until(lambda: stats(url)["running"] == 1)
        resp = generate(url, rid="same-rid")
        requests.post(f"{url}/abort_request", json={"rid": "same-rid"}, timeout=TIMEOUT)
        thread.join(10)
        after = generate(url, rid="same-rid", sampling_params={"max_new_tokens": 4})
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": "Duplicate request ID detected: same-rid"}}
    assert after.status_code == 200  # the rid is free again once the first one ended


def test_unknown_sampling_param_is_400_naming_it():
    with running_sim() as url:
        resp = generate(url, sampling_params={"max_new_tokens": 8, "max_tokens": 8})
        ignored = generate(url, sampling_params={"max_new_tokens": 8}, unknown_top_level=1)
    assert resp.status_code == 400
    # SGLang's schema decoder's own text, as the whole error value
    assert resp.json()["error"].startswith("unknown field `max_tokens`, expected one of "
                                           "`max_new_tokens`, `stop`, ")
    assert ignored.status_code == 200


def test_the_three_length_rules_answer_400_in_sglangs_words():
    # Context 100, so max_req_input_len is 94 (SGLang: context - 6).
    with running_sim(context_length=100) as url:
        too_long = generate(url, list(range(3, 103)))
        too_much = generate(url, list(range(3, 53)), sampling_params={"max_new_tokens": 60})
        exactly_full = generate(url, list(range(3, 53)), sampling_params={"max_new_tokens": 50})
        over_input_limit = generate(url, list(range(3, 97)), sampling_params={"max_new_tokens": 1})
        under_input_limit = generate(url, list(range(3, 96)),
                                     sampling_params={"max_new_tokens": 1})
    assert too_long.status_code == 400
    assert too_long.json() == {"error": {"message": "The input (100 tokens) is longer than the "
                                                    "model's context length (100 tokens)."}}
    assert too_much.status_code == 400
    assert too_much.json()["error"]["message"] == (
        "Requested token count exceeds the model's maximum context length of 100 tokens. "
        "You requested a total of 110 tokens: 50 tokens from the input messages and 60 tokens "
        "for the completion. Please reduce the number of tokens in the input messages or the "
        "completion to fit within the limit."
    )
    # input + max_new_tokens == context is accepted (SGLang refuses only a larger total)
    assert exactly_full.status_code == 200
    assert over_input_limit.status_code == 400
    assert over_input_limit.json()["error"]["message"] == (
        "Input length (94 tokens) exceeds the maximum allowed length (94 tokens). Use a "
        "shorter input or enable --allow-auto-truncate.")
    assert under_input_limit.status_code == 200


def test_api_key_is_required_except_for_health():
    with running_sim(api_key="s3cret") as url:
        denied = generate(url)
        wrong = generate(url, headers={"Authorization": "Bearer nope"})
        allowed = generate(url, headers={"Authorization": "Bearer s3cret"})
        info_denied = requests.get(f"{url}/server_info", timeout=TIMEOUT)
        health = requests.get(f"{url}/health", timeout=TIMEOUT)
    assert denied.status_code == 401 and wrong.status_code == 401
    assert allowed.status_code == 200
    assert info_denied.status_code == 401
    assert health.status_code == 200


def test_info_endpoints_report_model_and_limits():
    with running_sim(max_running_requests=7, context_length=4096, api_key="k") as url:
        get = lambda path: requests.get(  # noqa: E731
            f"{url}{path}", headers={"Authorization": "Bearer k"}, timeout=TIMEOUT)
        server = get("/server_info").json()
        model = get("/model_info").json()
        old_model = get("/get_model_info").json()
        models = get("/v1/models").json()
        health_generate = get("/health_generate")
    assert server["context_length"] == 4096 and server["max_running_requests"] == 7
    assert server["max_req_input_len"] == 4090 and server["max_total_num_tokens"] == 7 * 4096
    assert "api_key" not in server
    assert model == old_model
    assert model["model_path"] == "sim-model" and model["is_generation"] is True
    assert "tokenizer_path" in model
    assert models["data"][0]["id"] == "sim-model"
    assert models["data"][0]["max_model_len"] == 4096
    assert health_generate.status_code == 200


def test_a_default_launch_shows_no_context_length_but_its_limits_as_sglang_does():
    # SGLang's /server_info context_length is the launch argument: null without one. The
    # limits in force are max_req_input_len and /v1/models max_model_len.
    with running_sim(max_position_embeddings=2048) as url:
        server = requests.get(f"{url}/server_info", timeout=TIMEOUT).json()
        models = requests.get(f"{url}/v1/models", timeout=TIMEOUT).json()
        refused = generate(url, list(range(3, 2046)), sampling_params={"max_new_tokens": 1})
    assert server["context_length"] is None
    assert server["max_req_input_len"] == 2042
    assert models["data"][0]["max_model_len"] == 2048
    assert refused.status_code == 400 and "(2042 tokens)" in refused.json()["error"]["message"]


def test_request_log_records_dataset_header_and_output(tmp_path):
    path = tmp_path / "requests.jsonl"
    with running_sim(request_log=str(path)) as url:
        resp = generate(url, rid="logged-1", headers={"X-Datagen-Dataset": "B3_math"})
        generate(url, rid="logged-2", sampling_params={"bogus": 1})
        records = log(url)
        requests.post(f"{url}/_sim/reset", timeout=TIMEOUT)
        after_reset = log(url)
    ids = resp.json()["output_ids"]
    start, finish, reject = records
    assert (start["event"], start["rid"], start["dataset"]) == ("start", "logged-1", "B3_math")
    assert (finish["event"], finish["dataset"], finish["status"]) == ("finish", "B3_math", 200)
    assert finish["completion_tokens"] == len(ids) and finish["prompt_tokens"] == 3
    assert finish["output_sha"] == _sha(ids)
    assert (reject["event"], reject["rid"], reject["status"]) == ("reject", "logged-2", 400)
    assert after_reset == []
    assert [json.loads(line) for line in path.read_text().splitlines()] == records


def test_a_stream_whose_client_leaves_is_aborted():
    with running_sim(**SLOW) as url:
        resp = requests.post(f"{url}/generate", stream=True, timeout=TIMEOUT,
                             json={"input_ids": [5], "stream": True, "rid": "leaver",
                                   "sampling_params": LONG})
        next(resp.iter_lines())
        resp.close()
        wait_until(lambda: stats(url)["requests_aborted"] == 1)
        assert stats(url)["running"] == 0


def test_unknown_path_is_404():
    with running_sim() as url:
        assert requests.get(f"{url}/nope", timeout=TIMEOUT).status_code == 404
        assert requests.get(f"{url}/generate", timeout=TIMEOUT).status_code == 405


def _sha(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()
