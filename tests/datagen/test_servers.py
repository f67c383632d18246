"""The server kinds' request and answer mapping (datagen/servers), and the client on a vLLM
server as the simulator answers (``--kind vllm``; tests/real_vllm/test_vllm_server.py holds
the simulator's answers beside the real vLLM 0.32's and runs the client on the real one)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import wait_until

from config.settings import SettingsError, load_settings
from datagen.client import SGLangClient, new_rid
from datagen.errors import BadRequest, ServerUnavailable
from datagen.servers import KINDS, detect
from datagen.servers.base import HTTPStatusError, Limits, LimitsUnknown
from datagen.servers.vllm import finish_reason, sampling_params
from simulator.server import SimulatorConfig, start_in_thread

VLLM, SGLANG = KINDS["vllm"], KINDS["sglang"]


@pytest.fixture(scope="module")
def vllm_sim() -> Iterator[str]:
    url, stop = start_in_thread(SimulatorConfig(
        kind="vllm", context_length=1024, vocab_size=512, lengths="fixed:30000",
        decode_step_s=0.01, log_level="WARNING"))
    yield url
    stop()


# --- the request --------------------------------------------------------------------------

def test_sglang_sampling_params_become_vllm_s() -> None:
    body = VLLM.generate_body([1, 5, 6], {"max_new_tokens": 7, "min_new_tokens": 2,
                                          "sampling_seed": 3, "temperature": 0.7,
                                          "top_p": 0.95, "top_k": -1}, "r1")
    assert body == {"request_id": "r1", "token_ids": [1, 5, 6], "stream": False,
                    "sampling_params": {"max_tokens": 7, "min_tokens": 2, "seed": 3,
                                        "temperature": 0.7, "top_p": 0.95, "top_k": -1,
                                        "detokenize": False}}


def test_stop_strings_keep_vllm_detokenizing() -> None:
    assert sampling_params({"max_new_tokens": 4, "stop": ["\n\n"]})["detokenize"] is True


def test_a_sampling_param_vllm_would_silently_ignore_is_refused() -> None:
    # vLLM 0.32 answers 200 to {"max_new_tokens": 2} (it ignores the key and generates up to
    # the end of the context): a name that is not translated must not reach it
    with pytest.raises(BadRequest, match="stream_interval: no vLLM equivalent"):
        sampling_params({"max_new_tokens": 4, "stream_interval": 2})


def test_an_abort_names_the_id_vllm_runs_the_request_under() -> None:
    assert VLLM.abort_body("d1234abc") == {"request_ids": ["generate-tokens-d1234abc"]}
    assert SGLANG.abort_body("d1234abc") == {"rid": "d1234abc"}


# --- the answer ---------------------------------------------------------------------------

@pytest.mark.parametrize("reason, stop_reason, ids, want", [
    ("length", None, [7, 8, 9], {"type": "length", "length": 3}),
    ("stop", None, [7, 8, 2], {"type": "stop", "matched": 2}),  # EOS: the last id
    ("stop", 8, [7, 8], {"type": "stop", "matched": 8}),  # a stop_token_ids match
    ("stop", "\n\n", [7, 8], {"type": "stop", "matched": "\n\n"}),
    ("abort", None, [7], {"type": "abort", "message": "Aborted"}),
    ("repetition", None, [7, 7], {"type": "repetition", "stop_reason": None}),
])
def test_vllm_finish_reasons_in_sglang_s_shape(reason: str, stop_reason: Any, ids: list[int],
                                                want: dict) -> None:
    assert finish_reason(reason, stop_reason, ids) == want


def test_a_vllm_answer_reads_as_a_generation() -> None:
    data = {"request_id": "generate-tokens-r1",
            "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
            "choices": [{"index": 0, "finish_reason": "stop", "stop_reason": None,
                         "token_ids": [11, 12, 2]}]}
    gen = VLLM.parse_generation(data, 0.25)
    assert (gen.output_ids, gen.prompt_tokens, gen.completion_tokens, gen.latency_s) == (
        [11, 12, 2], 4, 3, 0.25)
    assert gen.finish_reason == {"type": "stop", "matched": 2}
    assert not gen.truncated and not gen.aborted


def test_sglangs_answer_to_a_request_aborted_in_its_waiting_queue_reads_as_an_abort() -> None:
    # as the real server answered it (no prompt_tokens, no output, no latency key of its own)
    data = {"text": "", "output_ids": [], "meta_info": {
        "id": "r1", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "weight_version": "default", "e2e_latency": 0.23,
        "weight_versions": [{"version": "default", "start": 0, "end": 0}],
        "completion_tokens": 0, "response_sent_to_client_ts": 1796437283.4}}
    gen = SGLANG.parse_generation(data, 0.5)
    assert gen.aborted and not gen.truncated
    assert (gen.output_ids, gen.prompt_tokens, gen.completion_tokens, gen.latency_s) == (
        [], 0, 0, 0.23)


def test_vllm_limits_come_from_max_model_len() -> None:
    answers = {"/v1/models": {"data": [{"owned_by": "vllm", "max_model_len": 4096}]}}
    limits = VLLM.limits(answers.__getitem__, "http://h:1")
    assert limits == Limits(4096, 4096, "http://h:1/v1/models max_model_len")
    # vLLM refuses a prompt of max_model_len tokens; the producer asks one token less
    assert limits.room(4095) == 0 and limits.room(4000) == 95
    with pytest.raises(LimitsUnknown, match="max_model_len from http://h:1/v1/models"):
        VLLM.limits({}.__getitem__, "http://h:1")


def test_the_kind_is_read_from_v1_models() -> None:
    def reader(owner: str | int) -> Any:
        def read(path: str) -> Any:
            if isinstance(owner, int):
                raise HTTPStatusError(owner, f"HTTP {owner}")
            return {"data": [{"owned_by": owner, "max_model_len": 8}]}
        return read
    assert detect(reader("vllm")) is VLLM
    assert detect(reader("sglang")) is SGLANG
    assert detect(reader(404)) is SGLANG  # a router without the route: the default
    with pytest.raises(OSError, match="HTTP 502"):  # a proxy before a server that is down
        detect(reader(502))


def test_server_kind_setting_is_checked() -> None:
    assert load_settings(None, env={"DATAGEN_SERVER_KIND": "vllm"}).server_kind == "vllm"
    with pytest.raises(SettingsError, match="server_kind: 'tgi' is not one of"):
        load_settings(None, env={"DATAGEN_SERVER_KIND": "tgi"})


# --- the client on the simulator's vLLM API -------------------------------------------------

@pytest.mark.parametrize("kind", ["vllm", "auto"])
def test_the_client_generates_on_a_vllm_server(vllm_sim: str, kind: str) -> None:
    client = SGLangClient(vllm_sim, kind=kind)
    assert client.limits().context_length == 1024 and client.healthy()
    gen = client.generate([1, 5, 6], {"max_new_tokens": 8, "temperature": 0.7}, new_rid("d"))
    assert client.kind is VLLM
    assert len(gen.output_ids) == gen.completion_tokens == 8 and gen.prompt_tokens == 3
    assert gen.finish_reason == {"type": "length", "length": 8}


def test_the_prompt_ids_logprobs_come_back_one_per_prompt_id_after_the_first(
        vllm_sim: str) -> None:
    # check_prompt_states asks vLLM for prompt_logprobs 0 (the prompt id's own); SGLang is
    # never asked (its input_token_logprobs are scaled by the temperature too)
    assert VLLM.generate_body([1], {"max_new_tokens": 2}, "r", prompt_logprobs=True)[
        "sampling_params"]["prompt_logprobs"] == 0
    assert "logprob_start_len" not in SGLANG.generate_body([1], {}, "r", True, True)
    client = SGLangClient(vllm_sim, kind="vllm")
    gen = client.generate([1, 5, 6, 9], {"max_new_tokens": 3}, new_rid("d"),
                          prompt_logprobs=True)
    assert gen.prompt_logprobs is not None and len(gen.prompt_logprobs) == 3
    assert all(x < 0 for x in gen.prompt_logprobs) and gen.logprobs is None
    assert client.generate([1, 5], {"max_new_tokens": 3}, new_rid("d")).prompt_logprobs is None
    # vLLM's own shape: the prompt id first, then a better-ranked one where it was not top
    answer = {"choices": [{"token_ids": [3], "finish_reason": "length"}],
              "prompt_logprobs": [None, {"5": {"logprob": -2.5, "rank": 3},
                                         "8": {"logprob": -0.1, "rank": 1}}]}
    assert VLLM.parse_generation(answer, 0.1).prompt_logprobs == (-2.5,)
    with pytest.raises(ValueError, match="first prompt id's null"):
        VLLM.parse_generation({**answer, "prompt_logprobs": [{"1": {"logprob": -1.0}}]}, 0.1)


def test_the_sampled_tokens_logprobs_come_back_one_per_output_id(vllm_sim: str) -> None:
    # check_states asks vLLM for logprobs 0; SGLang is never asked (its are scaled by the
    # temperature) and a call that does not ask gets none
    assert VLLM.generate_body([1], {"max_new_tokens": 2}, "r", logprobs=True)[
        "sampling_params"]["logprobs"] == 0
    assert "return_logprob" not in SGLANG.generate_body([1], {}, "r", logprobs=True)
    client = SGLangClient(vllm_sim, kind="vllm")
    gen = client.generate([1, 5, 6], {"max_new_tokens": 5}, new_rid("d"), logprobs=True)
    assert gen.logprobs is not None and len(gen.logprobs) == len(gen.output_ids) == 5
    assert all(x < 0 for x in gen.logprobs)
    assert client.generate([1, 5], {"max_new_tokens": 3}, new_rid("d")).logprobs is None
    with pytest.raises(ValueError, match="does not follow"):
        VLLM.parse_generation({"choices": [{"token_ids": [3, 4], "finish_reason": "length",
                                            "logprobs": {"content": [
                                                {"token_id": 4, "logprob": -1.0}]}}]}, 0.1)


def test_an_abort_by_rid_ends_a_vllm_request_in_flight(vllm_sim: str) -> None:
    client, rid, out = SGLangClient(vllm_sim, kind="vllm"), new_rid("d"), {}
    thread = threading.Thread(target=lambda: out.update(gen=client.generate(
        [1, 5, 6], {"max_new_tokens": 900}, rid)))
    thread.start()
    wait_until(lambda: any(r["event"] == "start" and r["rid"] == rid
                           for r in _sim_log(vllm_sim)), 30, what="the request to start")
    client.abort(rid)
    thread.join(30)
    gen = out["gen"]
    assert gen.aborted and gen.finish_reason == {"type": "abort", "message": "Aborted"}
    assert len(gen.output_ids) == gen.completion_tokens < 900


def test_a_prompt_too_long_for_vllm_is_a_bad_request_with_its_text(vllm_sim: str) -> None:
    client = SGLangClient(vllm_sim, kind="vllm")
    with pytest.raises(BadRequest, match=r"The decoder prompt \(length 1100\) is longer than "
                                         r"the maximum model length of 1024"):
        client.generate([1] * 1100, {"max_new_tokens": 4}, new_rid())


def test_an_sglang_client_on_a_vllm_server_fails_loudly(vllm_sim: str) -> None:
    client = SGLangClient(vllm_sim, kind="sglang")
    with pytest.raises(BadRequest, match="HTTP 404"):
        client.generate([1, 5], {"max_new_tokens": 4}, new_rid())
    with pytest.raises(ServerUnavailable, match="/server_info"):
        client.limits()
    assert not client.healthy()  # no /health_generate


def _sim_log(url: str) -> list[dict[str, Any]]:
    import requests

    return requests.get(f"{url}/_sim/log", timeout=10).json()


def test_an_auto_client_waits_for_a_server_that_does_not_answer_yet() -> None:
    # nothing listens on port 9: the kind stays unknown, the call is retryable
    client = SGLangClient("http://127.0.0.1:9", kind="auto", connect_timeout_s=2.0)
    with pytest.raises(ServerUnavailable, match="cannot tell the kind of the server"):
        client.generate([1, 5], {"max_new_tokens": 4}, new_rid())
    client.abort(new_rid())  # logged, not raised: a close goes on with the other aborts
    assert repr(client) == "SGLangClient(http://127.0.0.1:9, auto)"


def test_a_worker_with_check_prompt_states_stores_the_prompts_logprobs(stack: Any) -> None:
    # Given: a short worker on a vLLM server (the simulator) with check_prompt_states on
    from conftest import write_jsonl

    from datagen.generation.records import iter_records, records_dir, unpack_logprobs
    from producers.producer import Producer

    stack.start_simulator("--kind", "vllm", "--lengths", "fixed:6", "--decode-step-s", "0.001")
    part = write_jsonl(stack.tmp / "partition" / "B1.jsonl",
                       [{"id": f"s{i}", "prompt": f"hello number {i}"} for i in range(3)])
    settings = stack.configure(data_dir=str(part.parent), server_kind="vllm",
                               check_prompt_states=True, short_concurrency=3)
    stack.worker("short")
    stack.wait_workers(1)
    ledger = stack.ledger()

    # When: the samples run
    Producer(settings, stack.app(), ledger).run()
    wait_until(lambda: len(list(iter_records(records_dir(settings.output_dir, "B1")))) == 3,
               120, what="3 records stored")

    # Then: each record holds one float32 per prompt id after the first, and the outputs'
    for rec in iter_records(records_dir(settings.output_dir, "B1")):
        assert len(unpack_logprobs(rec["prompt_logprobs"])) == len(rec["prompt_ids"]) - 1
        assert len(unpack_logprobs(rec["output_logprobs"])) == len(rec["output_ids"])
