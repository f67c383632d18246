"""The Prometheus endpoint against a real Redis ledger, and over real HTTP on loopback."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from config.settings import Settings
from datagen.generation.ledger import Ledger, connect
from datagen.operations.metrics import make_server, record_request, render_metrics
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


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, read by Prometheus' own parser."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics_give_each_dataset_its_gauges(ledger: Ledger) -> None:
    samples = scrape(render_metrics(ledger))
    expected = {
        "datagen_tokens": {"A": 300, "B": 600},
        "datagen_budget_tokens": {"A": 1000, "B": 500},
        "datagen_generated_tokens": {"A": 300, "B": 600},
        "datagen_samples": {"A": 1, "B": 1},
        "datagen_truncated": {"A": 1, "B": 0},
        "datagen_in_flight": {"A": 1, "B": 0},
        "datagen_queued": {"A": 2, "B": 0},
        "datagen_dead_letters": {"A": 0, "B": 1},
        "datagen_closed": {"A": 0, "B": 1},
        "datagen_revoked": {"A": 2, "B": 0},
    }
    assert samples[("datagen_ledger_up", ())] == 1
    for name, per_dataset in expected.items():
        for dataset, value in per_dataset.items():
            assert samples[(name, (("dataset", dataset),))] == value, (name, dataset)
    assert "# TYPE datagen_tokens gauge" in render_metrics(ledger).splitlines()


def test_metrics_give_each_server_latency_tokens_and_in_flight(ledger: Ledger) -> None:
    text = render_metrics(ledger)
    samples = scrape(text)
    # The password in a server URL never reaches a label.
    masked = "http://user:***@gpu2:30000"

    def at(name: str, server: str) -> float | None:
        return samples.get((name, (("server", server),)))
    assert at("datagen_request_latency_seconds_sum", GPU1) == 6.5
    assert at("datagen_request_latency_seconds_count", GPU1) == 2
    assert at("datagen_request_latency_seconds_sum", masked) == 1.25
    assert at("datagen_request_latency_seconds_count", masked) == 1
    assert at("datagen_server_completion_tokens_total", GPU1) == 900
    assert at("datagen_server_completion_tokens_total", masked) == 40
    assert at("datagen_server_in_flight", masked) == 1
    assert at("datagen_server_in_flight", GPU1) is None
    assert "secret" not in text


def test_exposition_families_have_their_types(ledger: Ledger) -> None:
    families = {f.name: f for f in text_string_to_metric_families(render_metrics(ledger))}
    assert families["datagen_request_latency_seconds"].type == "summary"
    assert families["datagen_server_completion_tokens"].type == "counter"
    assert {s.labels["dataset"] for s in families["datagen_tokens"].samples} == {"A", "B"}


def test_metrics_say_the_ledger_is_down_when_redis_is_unreachable() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    down = Ledger(connect(url), Settings(redis_url=url))
    assert scrape(render_metrics(down)) == {("datagen_ledger_up", ()): 0}


def test_label_values_are_escaped(redis_url: str) -> None:
    led = Ledger(connect(redis_url), Settings(redis_url=redis_url))
    record_request(led.r, 'http://a"b\\c', 1.0, 1)
    text = render_metrics(led)
    assert 'datagen_request_latency_seconds_count{server="http://a\\"b\\\\c"} 1.0' in (
        text.splitlines())
    samples = scrape(text)
    assert samples[("datagen_request_latency_seconds_count", (("server", 'http://a"b\\c'),))] == 1


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
        assert resp.headers["Content-Type"].startswith("text/plain; version=")
        body = resp.read().decode()
    assert scrape(body)[("datagen_tokens", (("dataset", "A"),))] == 300
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{served}/other", timeout=5)
    assert err.value.code == 404
