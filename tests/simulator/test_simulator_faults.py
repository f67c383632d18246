"""Fault injection through POST /_sim/fault, for tests of client reliability."""

import time

import pytest
import requests
from simharness import TIMEOUT, generate, log, running_sim, stats, wait_until


def _fault(url: str, **spec: object) -> requests.Response:
    return requests.post(f"{url}/_sim/fault", json=spec, timeout=TIMEOUT)


def test_down_answers_503_for_count_requests_then_recovers():
    with running_sim() as url:
        _fault(url, mode="down", count=2)
        health_down = requests.get(f"{url}/health_generate", timeout=TIMEOUT).status_code
        codes = [generate(url).status_code for _ in range(3)]
        health_up = requests.get(f"{url}/health_generate", timeout=TIMEOUT).status_code
        plain_health = requests.get(f"{url}/health", timeout=TIMEOUT).status_code
    assert health_down == 503 and health_up == 200 and plain_health == 200
    assert codes == [503, 503, 200]


def test_down_for_a_duration_then_recovers():
    with running_sim() as url:
        _fault(url, mode="down", duration_s=0.2)
        first = generate(url).status_code
        time.sleep(0.3)
        later = generate(url).status_code
    assert (first, later) == (503, 200)


def test_error500_answers_500_with_an_error_body():
    with running_sim() as url:
        _fault(url, mode="error500", count=1)
        failed = generate(url, rid="e500")
        ok = generate(url)
        records = log(url)
    assert failed.status_code == 500 and "message" in failed.json()["error"]
    assert ok.status_code == 200
    assert records[0]["event"] == "reject" and records[0]["status"] == 500


def test_reset_before_any_byte_drops_the_connection_without_running():
    with running_sim() as url:
        _fault(url, mode="reset", phase="before", count=1)
        with pytest.raises(requests.exceptions.ConnectionError):
            generate(url, rid="gone")
        ok = generate(url)
        counters = stats(url)
    assert ok.status_code == 200
    assert counters["requests_reset"] == 1 and counters["requests_started"] == 1


def test_reset_mid_response_cuts_the_body_after_generating():
    with running_sim() as url:
        _fault(url, mode="reset", count=1)
        with pytest.raises((requests.exceptions.ConnectionError,
                            requests.exceptions.ChunkedEncodingError)):
            generate(url, rid="cut")
        events = [(r["event"], r["rid"]) for r in log(url)]
    # The tokens were made (and count) even though the client never got them.
    assert events == [("start", "cut"), ("finish", "cut"), ("reset", "cut")]


def test_reset_mid_stream_cuts_after_the_first_chunk():
    with running_sim(lengths="fixed:200") as url:
        _fault(url, mode="reset", count=1)
        resp = requests.post(f"{url}/generate", stream=True, timeout=TIMEOUT,
                             json={"input_ids": [3], "stream": True, "rid": "cut-stream"})
        lines = []
        with pytest.raises(requests.exceptions.ChunkedEncodingError):
            for line in resp.iter_lines():
                lines.append(line)
        wait_until(lambda: stats(url)["running"] == 0)
        counters = stats(url)
    assert len([x for x in lines if x]) == 1
    assert counters["requests_aborted"] == 1 and counters["requests_reset"] == 1


def _decode_s(url: str) -> float:
    """Decode time of one 200-token request on the engine's own clock: a loaded machine
    stretches the wall time of both requests compared, not this (it failed so, 0.17 s slow
    against 0.10 s normal, beside a second copy of the suite)."""
    before = stats(url)["decode_s"]
    assert generate(url).status_code == 200
    return stats(url)["decode_s"] - before


def test_slow_multiplies_the_step_time():
    with running_sim(lengths="fixed:200") as url:
        normal = _decode_s(url)
        _fault(url, mode="slow", factor=5)
        slow = _decode_s(url)
        _fault(url, mode="none")
        again = _decode_s(url)
    assert normal > 0
    assert slow > 3 * normal
    assert again < 2 * normal


def test_a_bad_fault_spec_is_400():
    with running_sim() as url:
        resp = _fault(url, mode="meltdown")
        state = requests.get(f"{url}/_sim/fault", timeout=TIMEOUT).json()
    assert resp.status_code == 400 and "meltdown" in resp.json()["error"]["message"]
    assert state["mode"] == "none"
