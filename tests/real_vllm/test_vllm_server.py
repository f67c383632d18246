"""Generation on a real vLLM 0.32 server (the CPU build in .venv-vllm), as workers run it.

One server for the module (an engine start is about 70 s on 2 cores), launched as DESIGN.md
says: ``--enable-scale-out --skip-tokenizer-init``, a tiny random Llama in float32 built
here (nothing downloaded). What is checked:

- the simulator's ``--kind vllm`` answers as this server does, request by request (status,
  error text, body keys, finish reasons), as tests/real_sglang holds the SGLang mode;
- the client: ids in and out exactly (greedy outputs equal transformers' greedy generate),
  finish reasons mapped to SGLang's shape, an abort by rid stops a request in flight, a
  prompt too long for the server is a BadRequest with vLLM's own text, the limits read
  from it, the kind detected from it;
- a real Celery worker run end to end on it (``datagen run``): every sample stored once,
  the ledger's tokens the sum of the records' completion tokens; an operator's close with
  abort_on_close, the engine frozen (SIGSTOP) from before the requests are sent and run
  only in steps the test takes, so the requests are surely in flight when the close
  comes: vLLM aborts each of the 4 by its id and none runs on; a worker SIGKILLed
  mid-request (the engine frozen and the worker stopped while the test makes sure two of
  its requests are running) and a restart: the killed requests end on vLLM, each sample
  runs once more only where reaped, and is counted once.

Every test that aborts or kills something in flight holds the engine that way: beside other
load, a decoding CPU engine kept the test's process from waking until its requests had ended.

Where .venv-vllm is missing the tests skip with the reason (`make vllm-env`); under CI=true
they fail instead.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from conftest import Stack, wait_until
from side_by_side import both, prompt, rid_of, sim_started
from vllm_fixture import (
    FrozenEngine,
    GenerationServer,
    configure_on,
    datagen_run,
    start_generation_server,
    vllm_python,
)

from cli.stack import start_simulator
from datagen.client import SGLangClient, new_rid, rid_prefix
from datagen.errors import BadRequest
from datagen.generation.ledger import Ledger
from datagen.generation.merge import merge_dataset
from datagen.generation.records import iter_records, records_dir
from datagen.servers import KINDS

pytestmark = [pytest.mark.timeout(1800), pytest.mark.usefixtures("cpu_hog_module")]

# --max-model-len: room for long requests. No length keeps a request in flight for a test
# that aborts it (16,368 tokens decoded in 33-40 s, ~400-500 tokens/s, on a loaded 2-core
# machine, 2026-12-04): those tests hold vLLM's engine stopped (FrozenEngine) instead.
CONTEXT = 16384
LONG = CONTEXT - 16  # max_tokens of a request a test aborts
EOS = 2  # the tiny tokenizer's <|eot|>, the model's eos_token_id
TIMEOUT = (10, 300)
GENERATE, ABORT = "/inference/v1/generate", "/inference/v1/abort_requests"

# Differences kept on purpose; each is either impossible or unwise to emulate.
NOT_EMULATED = {
    "token ids past the vocabulary": "vLLM without a tokenizer does not check them: the "
    "embedding lookup raises in its worker and the engine core dies (500 'EngineCore "
    "encountered an issue', then every request fails; seen here with id 600 of 512). The "
    "simulator answers 400; such a request is never sent to the real one.",
    "a request_id already in flight": "vLLM runs both (an abort then ends both); the "
    "simulator answers 400 as SGLang does. The pipeline's rids are unique.",
    "stream": "vLLM streams server-sent events; the simulator's vLLM mode refuses stream "
    "(the pipeline never streams).",
    "other validation texts": "FastAPI's texts for other malformed bodies (a wrong type "
    "coerced or refused, a body that is not JSON); the pipeline sends neither.",
    "logit_bias, stop strings, seeds": "the simulator's tokens are seeded draws, not a "
    "model's; it honours max_tokens, min_tokens, ignore_eos and stop_token_ids only.",
    "/health while starting": "vLLM listens only once its engine is up; the simulator's "
    "--startup-s 503s are SGLang's.",
    "the other routes": "/v1/completions, /metrics, /tokenize and the rest; the pipeline "
    "uses the five compared here.",
}


@dataclass
class Target:
    """One server under comparison: its URL and how to tell that a request is running."""

    name: str
    url: str
    running: Callable[[str], bool]

    def post(self, body: dict) -> requests.Response:
        return requests.post(f"{self.url}{GENERATE}", json=body, timeout=TIMEOUT)

    def abort(self, *ids: str) -> requests.Response:
        return requests.post(f"{self.url}{ABORT}", json={"request_ids": list(ids)},
                             timeout=30)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, encoder: Any
          ) -> tuple[Path, int]:
    """A random Llama of the tiny chat tokenizer's vocabulary, with it (2 heads of 64: vLLM's
    CPU attention takes head sizes of 32 and more), float32."""
    from datagen.builders.tiny_model import build_tiny_llama

    vllm_python()  # skip (or fail in CI) before building anything
    return build_tiny_llama(tmp_path_factory.mktemp("vllm-gen") / "model", encoder.vocab_size,
                            hidden_size=128, num_layers=2, heads=2,
                            tokenizer_dir=tokenizer_dir), encoder.vocab_size


@pytest.fixture(scope="module")
def vllm(model: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[GenerationServer]:
    started = time.monotonic()
    server = start_generation_server(model[0], tmp_path_factory.mktemp("logs") / "vllm.log",
                                     CONTEXT)
    print(f"FIGURE vLLM generation server ready after {time.monotonic() - started:.0f} s")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sim(model: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # Random weights rarely emit EOS, so the real server's answers run to max_tokens; the
    # simulator's do the same with a natural length past every cap used here.
    proc, url = start_simulator(tmp_path_factory.mktemp("sim"), [
        "--kind", "vllm", "--vocab-size", str(model[1]), "--eos-token-id", str(EOS),
        "--context-length", str(CONTEXT), "--lengths", "fixed:30000", "--decode-step-s",
        "0.005", "--model-path", "tiny"], name="sim-vllm")
    yield url
    proc.stop()


@pytest.fixture(scope="module")
def pair(vllm: GenerationServer, sim: str) -> list[Target]:
    return [Target("vllm", vllm.url, vllm.added), Target("simulator", sim, sim_started(sim))]


def answer(resp: requests.Response) -> tuple[int, Any]:
    return resp.status_code, (resp.json() if resp.content else resp.content)


def shape(body: dict) -> dict:
    """What must match in a successful answer: everything but the values that differ."""
    choice = body["choices"][0]
    return {"keys": sorted(body), "usage": sorted(body["usage"]), "choice": sorted(choice),
            "finish_reason": choice["finish_reason"], "stop_reason": choice["stop_reason"],
            "outputs": len(choice["token_ids"]),
            "prompt_tokens": body["usage"]["prompt_tokens"],
            "completion_tokens": body["usage"]["completion_tokens"],
            "weight_versions": choice["weight_versions"], "output_mode": body["output_mode"]}


def in_flight(target: Target, rid: str, cap: int) -> tuple[threading.Thread, dict]:
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(resp=target.post({
        "request_id": rid, "token_ids": prompt(8),
        "sampling_params": {"max_tokens": cap, "temperature": 0, "ignore_eos": True}})),
        daemon=True)
    thread.start()
    wait_until(lambda: target.running(rid) or "resp" in out, timeout_s=120, interval_s=0.02,
               what=f"{target.name} to run {rid}")
    return thread, out


# --- the simulator answers as vLLM does -----------------------------------------------------

def test_the_read_only_routes(pair: list[Target]) -> None:
    def scenario(t: Target) -> dict:
        models = requests.get(f"{t.url}/v1/models", timeout=30).json()
        entry = models["data"][0]
        health = requests.get(f"{t.url}/health", timeout=30)
        return {"models": sorted(models), "entry": sorted(entry), "owned_by": entry["owned_by"],
                "max_model_len": entry["max_model_len"], "id": entry["id"],
                "health": (health.status_code, health.content),
                "version": requests.get(f"{t.url}/version", timeout=30).json(),
                "sglang_routes": [requests.get(f"{t.url}{p}", timeout=30).status_code
                                  for p in ("/server_info", "/health_generate")]}
    real, simulated = both(pair, scenario)
    assert simulated == real
    assert real["owned_by"] == "vllm" and real["max_model_len"] == CONTEXT


def test_a_normal_request(pair: list[Target]) -> None:
    def scenario(t: Target) -> dict:
        rid = rid_of("normal")
        body = t.post({"request_id": rid, "token_ids": [1, 5, 6, 7],
                       "sampling_params": {"max_tokens": 8, "temperature": 0}}).json()
        return {**shape(body), "request_id": body["request_id"] == "generate-tokens-" + rid}
    real, simulated = both(pair, scenario)
    assert simulated == real
    assert real["finish_reason"] == "length" and real["request_id"]


def test_a_request_for_the_sampled_tokens_logprobs(pair: list[Target]) -> None:
    # the state check's request (check_states): sampling_params.logprobs = 0
    def scenario(t: Target) -> dict:
        body = t.post({"request_id": rid_of("logprobs"), "token_ids": [1, 5, 6, 7],
                       "sampling_params": {"max_tokens": 6, "temperature": 0,
                                           "logprobs": 0}}).json()
        choice = body["choices"][0]
        content = choice["logprobs"]["content"]
        return {**shape(body), "logprobs": sorted(choice["logprobs"]),
                "entry": sorted(content[0]), "tokens": [c["token_id"] for c in content]
                == choice["token_ids"], "negative": all(c["logprob"] < 0 for c in content),
                "top": [[x["token_id"] for x in c["top_logprobs"]] for c in content]
                == [[c["token_id"]] for c in content]}
    real, simulated = both(pair, scenario)
    assert simulated == real
    assert real["tokens"] and real["negative"] and real["top"]


def test_a_request_for_the_prompt_ids_logprobs(pair: list[Target]) -> None:
    # the prompt check's request (check_prompt_states): sampling_params.prompt_logprobs = 0
    def scenario(t: Target) -> dict:
        ids = [1, 5, 6, 7, 30]
        body = t.post({"request_id": rid_of("prompt-logprobs"), "token_ids": ids,
                       "sampling_params": {"max_tokens": 2, "temperature": 0,
                                           "prompt_logprobs": 0}}).json()
        entries = body["prompt_logprobs"]
        return {**shape(body), "first": entries[0], "count": len(entries),
                "keys": [list(e) for e in entries[1:]] == [[str(i)] for i in ids[1:]],
                "entry": sorted(entries[1][str(ids[1])]),
                "negative": all(e[str(i)]["logprob"] < 0
                                for e, i in zip(entries[1:], ids[1:], strict=True))}
    real, simulated = both(pair, scenario)
    assert simulated == real
    assert real["first"] is None and real["count"] == 5 and real["negative"]


@pytest.mark.parametrize("length, max_tokens", [
    (CONTEXT + 1, 1),  # longer than max_model_len
    (CONTEXT, 1),  # max_model_len: no room for one token
    (CONTEXT - 1, 8),  # served: one token, cut at max_model_len (length)
    (CONTEXT - 100, 200),  # prompt + max_tokens past max_model_len: served, cut there
])
def test_the_length_rules(pair: list[Target], length: int, max_tokens: int) -> None:
    def scenario(t: Target) -> tuple[int, Any]:
        resp = t.post({"token_ids": prompt(length), "sampling_params": {
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}})
        return (resp.status_code, shape(resp.json())) if resp.ok else answer(resp)
    real, simulated = both(pair, scenario)
    assert simulated == real


@pytest.mark.parametrize("params", [
    {"max_tokens": 2, "bogus": 1},  # unknown keys: ignored
    {"max_tokens": 0},
    {"max_tokens": 2, "temperature": -1},
    {"max_tokens": 4, "min_tokens": 5},
], ids=["unknown-key", "zero-max-tokens", "negative-temperature", "min-over-max"])
def test_sampling_params_the_pipeline_could_send(pair: list[Target], params: dict) -> None:
    def scenario(t: Target) -> tuple[int, Any]:
        resp = t.post({"token_ids": [1, 5], "sampling_params": params})
        return (resp.status_code, shape(resp.json())) if resp.ok else answer(resp)
    real, simulated = both(pair, scenario)
    assert simulated == real


@pytest.mark.parametrize("body", [
    {"token_ids": [], "sampling_params": {"max_tokens": 2}},
    {"token_ids": [1, 5]},
], ids=["empty-input", "no-sampling-params"])
def test_malformed_requests(pair: list[Target], body: dict) -> None:
    real, simulated = both(pair, lambda t: answer(t.post(body)))
    assert simulated == real
    assert real[0] == 400


def test_an_abort_by_the_exact_id_it_runs_under(pair: list[Target],
                                                 vllm: GenerationServer) -> None:
    # On vLLM the engine is frozen before the request is sent and runs only in steps until
    # the request made 10 tokens; the abort is sent with it stopped (a decoding CPU engine
    # beside other load ran a request to its cap before the test could abort it: seen in a
    # fresh clone's CI beside two burners). The simulator's request is slow enough as it is.
    def scenario(t: Target) -> dict:
        rid, cap = rid_of("abort"), LONG
        if t.name == "vllm":
            (thread, out), sent = vllm.abort_mid_decode(
                rid, lambda: in_flight(t, rid, cap), lambda: t.abort("generate-tokens-" + rid))
        else:
            thread, out = in_flight(t, rid, cap)
            sent = t.abort("generate-tokens-" + rid)
        thread.join(120)
        body = out["resp"].json()
        seen = shape(body)
        made = seen.pop("outputs"), seen.pop("completion_tokens"), seen.pop("weight_versions")
        return {"abort_answer": (sent.status_code, sent.content),
                "status": out["resp"].status_code, **seen,
                "partial": made[0] == made[1] < cap}
    real, simulated = both(pair, scenario)
    assert simulated == real
    assert real["partial"] and real["finish_reason"] == "abort"
    assert real["abort_answer"] == (200, b"")


def test_an_abort_by_the_request_id_as_sent_aborts_nothing(pair: list[Target]) -> None:
    def scenario(t: Target) -> dict:
        rid, cap = rid_of("plain"), 200
        thread, out = in_flight(t, rid, cap)
        answered = t.abort(rid)
        thread.join(300)
        return {"abort_answer": answered.status_code,
                "finish_reason": out["resp"].json()["choices"][0]["finish_reason"],
                "outputs": len(out["resp"].json()["choices"][0]["token_ids"])}
    real, simulated = both(pair, scenario)
    assert simulated == real == {"abort_answer": 200, "finish_reason": "length", "outputs": 200}


@pytest.mark.parametrize("body", [{"request_ids": ["generate-tokens-nobody"]},
                                  {"rid": "nobody"}], ids=["unknown-id", "no-request-ids"])
def test_other_aborts(pair: list[Target], body: dict) -> None:
    real, simulated = both(pair, lambda t: answer(requests.post(
        f"{t.url}{ABORT}", json=body, timeout=30)))
    assert simulated == real


def test_a_stop_on_a_token_the_answer_makes(pair: list[Target]) -> None:
    def scenario(t: Target) -> dict:
        body = {"token_ids": [1, 9, 10, 11], "sampling_params": {"max_tokens": 12,
                                                                   "temperature": 0}}
        free = t.post(body).json()["choices"][0]["token_ids"]
        stop_id = free[4]
        stopped = t.post({**body, "sampling_params": {**body["sampling_params"],
                                                      "stop_token_ids": [stop_id]}}).json()
        choice = stopped["choices"][0]
        return {"finish_reason": choice["finish_reason"],
                "stop_reason_is_the_id": choice["stop_reason"] == stop_id,
                "ends_with_it": choice["token_ids"][-1] == stop_id,
                "prefix_of_the_free_answer": choice["token_ids"] == free[:len(
                    choice["token_ids"])]}
    real, simulated = both(pair, scenario)
    assert simulated == real
    assert real == {"finish_reason": "stop", "stop_reason_is_the_id": True,
                    "ends_with_it": True, "prefix_of_the_free_answer": True}


# --- the client on the real server ----------------------------------------------------------

def transformers_greedy(model_dir: Path, ids: list[int], max_new: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                             eos_token_id=EOS, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_ids_in_and_out_exactly_greedy_as_transformers(vllm: GenerationServer,
                                                       model: tuple[Path, int]) -> None:
    client = SGLangClient(vllm.url, kind="auto")
    prompts = [[1, 4, 17, 99, 250], [1] + list(range(300, 340)), [1, 7, 7, 7, 2, 3, 4]]
    got = [client.generate(ids, {"max_new_tokens": 24, "temperature": 0}, new_rid("greedy"))
           for ids in prompts]
    assert client.kind is KINDS["vllm"]  # read from the server's /v1/models
    for ids, gen in zip(prompts, got, strict=True):
        assert gen.output_ids == transformers_greedy(model[0], ids, 24)
        assert gen.prompt_tokens == len(ids) and gen.completion_tokens == len(gen.output_ids)
        want = ({"type": "stop", "matched": EOS} if gen.output_ids[-1] == EOS
                else {"type": "length", "length": 24})
        assert gen.finish_reason == want


def test_finish_reasons_in_sglang_s_shape(vllm: GenerationServer) -> None:
    client = SGLangClient(vllm.url, kind="vllm")
    ids = [1, 9, 10, 11]
    free = client.generate(ids, {"max_new_tokens": 12, "temperature": 0}, new_rid())
    assert free.finish_reason == {"type": "length", "length": 12} and free.truncated
    stop_id = free.output_ids[5]
    stopped = client.generate(ids, {"max_new_tokens": 12, "temperature": 0,
                                    "stop_token_ids": [stop_id]}, new_rid())
    assert stopped.finish_reason == {"type": "stop", "matched": stop_id}
    assert stopped.output_ids == free.output_ids[:free.output_ids.index(stop_id) + 1]
    # EOS made certain by a bias, held back by min_new_tokens: stop_reason null on vLLM
    eos = client.generate(ids, {"max_new_tokens": 12, "temperature": 0, "min_new_tokens": 3,
                                "logit_bias": {str(EOS): 100.0}}, new_rid())
    assert eos.finish_reason == {"type": "stop", "matched": EOS}
    assert len(eos.output_ids) == 4 and eos.output_ids[-1] == EOS


def test_an_abort_by_rid_stops_a_request_in_flight(vllm: GenerationServer) -> None:
    # (the engine is frozen before the request is sent and runs only in steps until the
    # request made 100 tokens; the abort is sent with it stopped: the request is surely
    # mid-decode then, however slow or starved the machine)
    client, rid, out, cap = SGLangClient(vllm.url, kind="vllm"), new_rid("abort"), {}, LONG
    thread = threading.Thread(target=lambda: out.update(gen=client.generate(
        [1, 5, 6], {"max_new_tokens": cap, "ignore_eos": True}, rid)), daemon=True)

    def abort() -> None:
        assert thread.is_alive() and not out
        client.abort(rid)
    vllm.abort_mid_decode(rid, thread.start, abort, tokens=100)
    asked = time.monotonic()
    thread.join(60)
    answered_s = time.monotonic() - asked
    gen = out["gen"]
    print(f"FIGURE abort answered {answered_s:.3f} s after the engine went on, "
          f"{gen.completion_tokens} tokens")
    assert gen.aborted and gen.finish_reason == {"type": "abort", "message": "Aborted"}
    assert 100 <= len(gen.output_ids) == gen.completion_tokens < cap
    # the engine was told: its own log names the request it aborted
    assert f"Aborted request(s) generate-tokens-{rid}" in vllm.log.read_text(errors="replace")


def test_a_prompt_too_long_is_a_bad_request_with_vllm_s_text(vllm: GenerationServer) -> None:
    client = SGLangClient(vllm.url, kind="vllm")
    limits = client.limits()
    assert (limits.context_length, limits.max_input_tokens) == (CONTEXT, CONTEXT)
    assert limits.room(CONTEXT - 1) == 0 and limits.refusal(CONTEXT - 1)
    with pytest.raises(BadRequest) as err:
        client.generate(prompt(CONTEXT), {"max_new_tokens": 1}, new_rid())
    assert str(err.value).startswith(f"The decoder prompt (length {CONTEXT}) plus the number "
                                     "of requested output tokens (at least 1) is longer than "
                                     f"the maximum model length of {CONTEXT}.")
    assert client.healthy()


# --- a real worker run ----------------------------------------------------------------------

def test_a_worker_run_on_vllm_stores_each_sample_once_and_counts_its_tokens(
        stack: Stack, vllm: GenerationServer, model: tuple[Path, int]) -> None:
    # Given: a short worker on the real vLLM server (server_kind vllm), 12 prompts, greedy
    settings = configure_on(
        stack, vllm, model[0], "B1_vllm", [(f"s{i}", f"Say hello number {i}") for i in range(12)],
        sampling_params={"temperature": 0}, short_concurrency=4, short_max_tokens=32,
        read_timeout_s=600.0)
    stack.worker("short")
    stack.wait_workers(1)

    # When: `datagen run` produces and follows the run to its end
    print(f"FIGURE datagen run on vLLM: {datagen_run(stack):.1f} s for 12 samples")

    # Then: every sample stored once and counted once
    ledger = Ledger.from_settings(settings)
    merged = merge_dataset(settings.output_dir, "B1_vllm", ledger.committed("B1_vllm"))
    assert merged.records == 12 and merged.duplicates == 0
    recs = list(iter_records(records_dir(settings.output_dir, "B1_vllm")))
    assert sorted(r["id"] for r in recs) == sorted(f"s{i}" for i in range(12))
    assert ledger.snapshot("B1_vllm")["tokens"] == sum(r["trainable_tokens"] for r in recs)
    for rec in recs:
        assert rec["prompt_ids"] == stack.encoder.encode(rec["messages"])
        assert len(rec["output_ids"]) == rec["completion_tokens"] > 0
        reason = rec["finish_reason"]
        assert reason in ({"type": "length", "length": 32}, {"type": "stop", "matched": EOS})
        assert rec["truncated"] == (reason["type"] == "length")
        assert rec["server"] == vllm.url
    print("FIGURE records:", json.dumps({r["id"]: r["completion_tokens"] for r in recs}))


def test_an_operator_close_aborts_the_requests_in_flight_on_vllm(
        stack: Stack, vllm: GenerationServer, model: tuple[Path, int]) -> None:
    # Given: a worker with 4 requests running on the real server (capped at CONTEXT / 2),
    # abort_on_close on. vLLM's engine is frozen before they are sent and runs only in steps
    # until they decode: however slow or starved this machine, the 4 are still in flight
    # when the close comes. (Unfrozen, a loaded 2-core runner let them end before the close's
    # aborts were sent; frozen only once they ran, a test process starved for 30 s saw
    # them end before the freeze: the test then measured the machine.)
    from datagen.generation import guard
    from producers.producer import Producer

    dataset, cap = "B2_close", CONTEXT // 2
    settings = configure_on(
        stack, vllm, model[0], dataset, [(f"c{i}", f"Tell me about topic {i}") for i in range(8)],
        sampling_params={"temperature": 0, "ignore_eos": True}, short_concurrency=4,
        short_max_tokens=cap, abort_on_close=True, precise_admission=False,
        read_timeout_s=600.0, lease_s=60.0,
        log_each_task=True)  # Celery's per-task "succeeded" lines carry each outcome
    stack.worker("short")
    stack.wait_workers(1)
    ledger, app = stack.ledger(), stack.app()
    made = vllm.metric("vllm:generation_tokens_total")
    with vllm.engine_frozen() as engine:
        Producer(settings, app, ledger).run()
        wait_until(lambda: len(ledger.in_flight(dataset)) == 4 and all(
            vllm.added(e["rid"]) for e in ledger.in_flight(dataset).values()), 600, 0.05,
            what="4 requests sent to vLLM")
        engine.step_until(lambda: vllm.metric("vllm:generation_tokens_total") >= made + 40,
                          600, what="the 4 to decode")

        # When: an operator closes the dataset while they run
        rids = {e["rid"] for e in ledger.in_flight(dataset).values()}
        assert len(rids) == 4, "a request ended while the engine was stopped"
        assert guard.close(app, ledger, dataset, "operator", abort_in_flight=True)
        wait_until(lambda: vllm.aborted(rids) == rids, 60, 0.1,
                   what="vLLM's API server to take the 4 aborts")
    closed = time.monotonic()
    wait_until(lambda: ledger.snapshot(dataset)["in_flight"] == 0, 120, 0.05,
               what="the requests in flight to end")
    ended_s = time.monotonic() - closed

    # Then: vLLM aborted each of the 4 by its id and the worker had 4 aborted answers (none ran
    # on to its cap); none was stored or counted, and nothing more started
    print(f"FIGURE close on vLLM: 4 in flight, 4 aborted, all ended {ended_s:.2f} s after "
          "the engine went on")
    worker_log = "".join(f.read_text(errors="replace")
                         for f in (stack.tmp / "logs").glob("worker-short-*.log"))
    assert worker_log.count("'discarded'") == 4
    assert not list(iter_records(records_dir(settings.output_dir, dataset)))
    snap = ledger.snapshot(dataset)
    assert snap["tokens"] == 0 and int(snap["stats"].get("discarded_tokens", 0)) < 4 * cap
    log = vllm.log.read_text(errors="replace")
    prefix = f"Added request generate-tokens-{rid_prefix(dataset)}"
    assert log.count(prefix) == len(rids)  # each once, and none after the close


def test_a_killed_worker_s_samples_run_once_more_and_a_restart_resumes_on_vllm(
        stack: Stack, vllm: GenerationServer, model: tuple[Path, int]) -> None:
    # Given: a worker of 2 threads on the real server, 32 prompts each decoding to its cap
    # of 160 tokens (greedy, ignore_eos), lease 6 s
    from producers.producer import Producer

    dataset = "B3_kill"
    settings = configure_on(
        stack, vllm, model[0], dataset,
        [(f"k{i}", f"Write about subject {i}") for i in range(32)],
        sampling_params={"temperature": 0, "ignore_eos": True}, short_concurrency=2,
        short_max_tokens=160, lease_s=6.0, read_timeout_s=600.0)
    victim = stack.worker("short", name="victim@%h")
    stack.wait_workers(1)
    ledger = stack.ledger()
    Producer(settings, stack.app(), ledger).run()

    def held() -> dict[str, str]:
        return {s: e["rid"] for s, e in ledger.in_flight(dataset).items()}

    def two_running() -> bool:
        return (len(ledger.committed(dataset)) >= 2 and len(held()) == 2
                and all(vllm.added(r) for r in held().values()))

    # When: the worker is SIGKILLed with 2 requests running on vLLM and some samples done
    # (both hold from its third sample to its last but two: events, not a time window);
    # a new worker and `datagen run` then restart the run, and its reaper finds the leases.
    # The engine is frozen and decodes only in steps, and the worker is stopped before the
    # ledger is read for the last time: between a look and the kill, nothing can finish a
    # request or commit a sample (beside two CPU burners the worker once committed one there).
    with vllm.engine_frozen() as engine:
        while True:
            engine.step_until(two_running, 300, what="2 samples done and 2 requests running")
            worker = FrozenEngine.group(victim.pid, "the worker")
            worker.stop()
            if two_running():
                break
            worker.go()  # it committed a sample meanwhile: step on
        victim.kill()
        lost = held()
    done_at_restart = set(ledger.committed(dataset))
    assert len(lost) == 2 and 2 <= len(done_at_restart) < 32
    stack.worker("short", name="fresh@%h")
    datagen_run(stack)

    # Then: each sample stored once and counted once at its full length; the killed
    # requests ended on vLLM (aborted by their ids, not run on to their caps); every request
    # vLLM ran is a counted one or a reaped one (nothing done before the restart ran again).
    # (A request the worker had admitted but not yet sent when it died never reached vLLM.)
    merged = merge_dataset(settings.output_dir, dataset, ledger.committed(dataset))
    # (a record stored but not yet counted when the worker died is stored again by its re-run:
    # the merge keeps the counted one)
    assert merged.records == 32
    assert len({json.loads(x)["id"] for x in Path(merged.path).read_text().splitlines()}) == 32
    committed = {s: v.split(" ")[0] for s, v in ledger.committed(dataset).items()}
    assert all(committed[s] != rid for s, rid in lost.items())
    snap = ledger.snapshot(dataset)
    assert snap["tokens"] == 32 * 159  # 160 generated; the row's last trains nothing
    ran = [rid for rid in lost.values() if vllm.added(rid)]
    assert ran, "the kill found no request of the worker running on vLLM"
    log = vllm.log.read_text(errors="replace")
    assert all(f"Aborted request(s) generate-tokens-{rid}" in log for rid in ran)
    reaped = int(snap["stats"].get("reaped", 0))
    assert reaped >= len(lost)
    sent = log.count(f"Added request generate-tokens-{rid_prefix(dataset)}")
    assert 32 + len(ran) <= sent <= 32 + reaped
    print(f"FIGURE kill on vLLM: {len(ran)} killed requests aborted on the server, "
          f"{reaped} reaped in all, {len(done_at_restart)} of 32 done at the restart, "
          "32 counted once")


def test_a_budget_stops_the_dataset_on_vllm_and_nothing_runs_on(
        stack: Stack, vllm: GenerationServer, model: tuple[Path, int]) -> None:
    # Given: 40 prompts each decoding to its cap of 48 tokens (greedy, ignore_eos), a budget
    # of 600 tokens (12.5 answers), a worker of 4 threads, abort_on_close on
    import re

    dataset, budget, cap, threads = "B4_budget", 600, 48, 4
    settings = configure_on(
        stack, vllm, model[0], dataset, [(f"b{i}", f"Explain item {i}") for i in range(40)],
        sampling_params={"temperature": 0, "ignore_eos": True}, short_concurrency=threads,
        short_max_tokens=cap, budgets={dataset: budget}, token_budget=10**9,
        abort_on_close=True, read_timeout_s=600.0)
    stack.worker("short")
    stack.wait_workers(1)

    # When: `datagen run` runs it to its end
    datagen_run(stack)

    # Then: closed by its budget, at or over it by less than the requests one worker had in
    # flight could add; each stored sample counted once; every request of the dataset vLLM
    # ran is a counted one or ended there by an abort (none ran on after the close)
    ledger = stack.ledger()
    snap = ledger.snapshot(dataset)
    assert snap["closed"] == "budget"
    assert budget <= snap["tokens"] < budget + threads * cap, snap["tokens"]
    committed = ledger.committed(dataset)
    merged = merge_dataset(settings.output_dir, dataset, committed)
    assert merged.duplicates == 0 and merged.records == snap["stats"]["samples"] < 40
    assert snap["tokens"] == (cap - 1) * merged.records  # the row's last trains nothing
    log = vllm.log.read_text(errors="replace")
    ran = set(re.findall(rf"Added request generate-tokens-({rid_prefix(dataset)}[0-9a-f]+)",
                         log))
    counted = {v.split(" ")[0] for v in committed.values()}
    assert counted <= ran
    ran_on = {r for r in ran - counted if f"Aborted request(s) generate-tokens-{r}" not in log}
    assert not ran_on, sorted(ran_on)
    print(f"FIGURE budget on vLLM: {snap['tokens']} tokens counted for a budget of {budget} "
          f"({100 * (snap['tokens'] - budget) / budget:.1f}% over), {merged.records} of 40 "
          f"samples, {len(ran - counted)} requests aborted at the close")
