"""The Prometheus endpoint against a real Redis ledger, and over real HTTP on loopback."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from config.settings import Settings
from datagen.generation.ledger import Ledger, connect
from datagen.metrics import CONTENT_TYPE, make_server, record_request, render_metrics
from datagen.redis_server import free_port

GPU1 = "http://gpu1:30000"
GPU2 = "http://user:secret@gpu2:30000"


@pytest.fixture
def ledger(redis_url: str) -> Ledger:
    # Given two datasets: A open with one commit, one request in flight, one queued and
    # one revoked task; B closed at its budget with a dead letter.
    settings = Settings(redis_url=redis_url, token_budget=1000, budgets={"B": 500})
    led = Ledger(connect(redis_url), settings)
    led.register(["A", "B"])
    led.mark_run()
    led.add_pending("A", {"a1": "{}", "a2": "{}", "a3": "{}"})
    assert led.admit("A", "a1", "r1", "w", 10, 100, precise=False, server=GPU1).status == "ok"
    led.commit("A", "a1", "r1", 10, 300, True, 2.0)
    assert led.admit("A", "a2", "r2", "w", 10, 100, precise=False, server=GPU2).status == "ok"
    led.count("A", "revoked", 2)
    assert led.admit("B", "b1", "r3", "w", 10, 100, precise=False, server=GPU1).status == "ok"
    led.commit("B", "b1", "r3", 10, 600, False, 4.0)
    led.dead_letter("B", "b9", "permanent error")
    record_request(led.r, GPU1, 2.0, 300)
    record_request(led.r, GPU1, 4.5, 600)
    record_request(led.r, GPU2, 1.25, 40)
    return led


def test_metrics_give_each_dataset_its_gauges(ledger: Ledger) -> None:
    lines = render_metrics(ledger).splitlines()
    expected = [
        "datagen_ledger_up 1",
        'datagen_tokens{dataset="A"} 300',
        'datagen_tokens{dataset="B"} 600',
        'datagen_budget_tokens{dataset="A"} 1000',
        'datagen_budget_tokens{dataset="B"} 500',
        'datagen_samples{dataset="A"} 1',
        'datagen_samples{dataset="B"} 1',
        'datagen_truncated{dataset="A"} 1',
        'datagen_truncated{dataset="B"} 0',
        'datagen_in_flight{dataset="A"} 1',
        'datagen_in_flight{dataset="B"} 0',
        'datagen_queued{dataset="A"} 2',
        'datagen_queued{dataset="B"} 0',
        'datagen_dead_letters{dataset="A"} 0',
        'datagen_dead_letters{dataset="B"} 1',
        'datagen_closed{dataset="A"} 0',
        'datagen_closed{dataset="B"} 1',
        'datagen_revoked{dataset="A"} 2',
        'datagen_revoked{dataset="B"} 0',
    ]
    for line in expected:
        assert line in lines
    assert "# TYPE datagen_tokens gauge" in lines


def test_metrics_give_each_server_latency_tokens_and_in_flight(ledger: Ledger) -> None:
    lines = render_metrics(ledger).splitlines()
    # The password in a server URL never reaches a label.
    masked = "http://user:***@gpu2:30000"
    for line in [
        "# TYPE datagen_request_latency_seconds summary",
        f'datagen_request_latency_seconds_sum{{server="{GPU1}"}} 6.5',
        f'datagen_request_latency_seconds_count{{server="{GPU1}"}} 2',
        f'datagen_request_latency_seconds_sum{{server="{masked}"}} 1.25',
        f'datagen_request_latency_seconds_count{{server="{masked}"}} 1',
        f'datagen_server_completion_tokens_total{{server="{GPU1}"}} 900',
        f'datagen_server_completion_tokens_total{{server="{masked}"}} 40',
        f'datagen_server_in_flight{{server="{masked}"}} 1',
    ]:
        assert line in lines
    assert not any("secret" in line for line in lines)
    assert not any(line.startswith(f'datagen_server_in_flight{{server="{GPU1}"')
                   for line in lines)


def test_exposition_parses_with_the_reference_parser(ledger: Ledger) -> None:
    parser = pytest.importorskip("prometheus_client.parser")  # comes with flower
    families = {f.name: f for f in parser.text_string_to_metric_families(
        render_metrics(ledger))}
    assert families["datagen_request_latency_seconds"].type == "summary"
    assert families["datagen_server_completion_tokens"].type == "counter"
    assert {s.labels["dataset"] for s in families["datagen_tokens"].samples} == {"A", "B"}


def test_metrics_say_the_ledger_is_down_when_redis_is_unreachable() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    down = Ledger(connect(url), Settings(redis_url=url))
    assert render_metrics(down).splitlines()[-1] == "datagen_ledger_up 0"


def test_label_values_are_escaped(redis_url: str) -> None:
    led = Ledger(connect(redis_url), Settings(redis_url=redis_url))
    record_request(led.r, 'http://a"b\\c', 1.0, 1)
    assert 'datagen_request_latency_seconds_count{server="http://a\\"b\\\\c"} 1' in (
        render_metrics(led).splitlines())


@pytest.fixture
def served(ledger: Ledger) -> Iterator[str]:
    server = make_server(ledger, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_server_serves_metrics_over_http(served: str) -> None:
    with urllib.request.urlopen(f"{served}/metrics", timeout=5) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == CONTENT_TYPE
        body = resp.read().decode()
    assert 'datagen_tokens{dataset="A"} 300' in body.splitlines()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{served}/other", timeout=5)
    assert err.value.code == 404
