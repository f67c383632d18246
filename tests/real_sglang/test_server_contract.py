"""The SGLang contract the pipeline relies on, checked against a real SGLang 0.5.23 server."""

from __future__ import annotations

import requests
from sglang_fixture import RealServer


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
