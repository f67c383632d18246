"""A Prometheus endpoint over the ledger: per-dataset gauges and per-server request latency.

A ``prometheus_client`` collector reads the ledger afresh on every scrape; nothing is cached,
so several metrics processes may serve the same run.

Per-server latency comes from three hashes keyed by the server's URL (password masked),
bumped once per committed request by ``record_request``. They add up forever, like
Prometheus counters: rate(sum)/rate(count) is the mean latency over any window.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import MetricsHandler
from prometheus_client.registry import Collector

from config.settings import Settings, masked_url
from datagen import keys
from datagen.generation.ledger import Ledger

log = logging.getLogger(__name__)

# HASH server -> requests committed / seconds they took end to end / completion tokens.
SERVER_REQUESTS = keys.SERVER_REQUESTS
SERVER_LATENCY_S = keys.SERVER_LATENCY_S
SERVER_TOKENS = keys.SERVER_TOKENS

# (name, help, snapshot -> value) of the per-dataset gauges.
DATASET_GAUGES: list[tuple[str, str, Any]] = [
    ("datagen_tokens", "Tokens committed against the budget (the budget measure).",
     lambda s: s["tokens"]),
    ("datagen_budget_tokens", "The dataset's token budget.", lambda s: s["budget"]),
    ("datagen_generated_tokens", "Tokens the committed samples generated, inside the "
     "training window or not.", lambda s: s["stats"].get("completion_tokens", 0)),
    ("datagen_samples", "Samples committed.", lambda s: s["stats"].get("samples", 0)),
    ("datagen_truncated", "Committed samples cut at max_new_tokens.",
     lambda s: s["stats"].get("truncated", 0)),
    ("datagen_in_flight", "Requests admitted and not yet committed or released.",
     lambda s: s["in_flight"]),
    ("datagen_queued", "Samples enqueued and not done yet.", lambda s: s["pending"]),
    ("datagen_dead_letters", "Samples given up on (will not be retried).", lambda s: s["dead"]),
    ("datagen_closed", "1 when the dataset is closed (budget, max_samples or operator).",
     lambda s: int(bool(s["closed"]))),
    ("datagen_revoked", "Tasks dropped because their dataset was closed.",
     lambda s: s["stats"].get("revoked", 0)),
]


def record_request(client: redis.Redis, server: str, latency_s: float,
                   completion_tokens: int) -> None:
    """Count one committed request against its server (the writing side, for the worker)."""
    label = masked_url(server)
    with client.pipeline(transaction=False) as pipe:
        pipe.hincrby(SERVER_REQUESTS, label, 1)
        pipe.hincrbyfloat(SERVER_LATENCY_S, label, latency_s)
        pipe.hincrby(SERVER_TOKENS, label, completion_tokens)
        pipe.execute()


class LedgerCollector(Collector):
    """Every metric family, read from the ledger at scrape time; ``datagen_ledger_up 0``
    alone when Redis cannot be read."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("datagen_ledger_up", "1 when the ledger could be read from Redis.")
        try:
            names = self.ledger.datasets()
            families = [*_dataset_metrics(self.ledger, names),
                        *_server_metrics(self.ledger, names)]
        except redis.exceptions.RedisError as exc:
            log.warning("metrics: cannot read the ledger: %s", type(exc).__name__)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families


def registry_of(ledger: Ledger) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LedgerCollector(ledger))
    return registry


def render_metrics(ledger: Ledger) -> str:
    """The whole exposition, in Prometheus' text format."""
    return generate_latest(registry_of(ledger)).decode("utf-8")


def _dataset_metrics(ledger: Ledger, names: list[str]) -> list[Metric]:
    snaps = [ledger.snapshot(name) for name in names]
    families = []
    for metric, text, value in DATASET_GAUGES:
        family = GaugeMetricFamily(metric, text, labels=["dataset"])
        for snap in snaps:
            family.add_metric([snap["dataset"]], value(snap))
        families.append(family)
    return families


def _server_metrics(ledger: Ledger, names: list[str]) -> list[Metric]:
    with ledger.r.pipeline(transaction=False) as pipe:
        pipe.hgetall(SERVER_REQUESTS)
        pipe.hgetall(SERVER_LATENCY_S)
        pipe.hgetall(SERVER_TOKENS)
        for name in names:
            pipe.hvals(ledger.k(name, keys.INFLIGHT))
        counts, seconds, tokens, *in_flight = pipe.execute()
    servers = sorted(counts)
    latency = SummaryMetricFamily(
        "datagen_request_latency_seconds",
        "End-to-end /generate latency of committed requests, per server.", labels=["server"])
    completion = CounterMetricFamily(
        "datagen_server_completion_tokens",
        "Completion tokens of committed requests, per server.", labels=["server"])
    for server in servers:
        latency.add_metric([server], int(counts[server]), float(seconds.get(server, 0)))
        completion.add_metric([server], int(tokens.get(server, 0)))
    running = GaugeMetricFamily(
        "datagen_server_in_flight", "Requests in flight, per server (from the ledger's leases).",
        labels=["server"])
    by_server = _in_flight_by_server(in_flight)
    for server in sorted(by_server):
        running.add_metric([server], by_server[server])
    return [latency, completion, running]


def _in_flight_by_server(entries_per_dataset: Iterable[list[str]]) -> Counter[str]:
    by_server: Counter[str] = Counter()
    for entries in entries_per_dataset:
        for raw in entries:
            by_server[masked_url(json.loads(raw).get("server") or "unknown")] += 1
    return by_server


class _Handler(MetricsHandler):
    """prometheus_client's handler, on /metrics only."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.split("?", 1)[0] != "/metrics":
            body = b"try /metrics\n"
            self.send_response(404)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("metrics %s: " + format, self.address_string(), *args)


def make_server(ledger: Ledger, host: str = "127.0.0.1", port: int = 9108
                ) -> ThreadingHTTPServer:
    """A bound server (port 0 picks a free one); call ``serve_forever`` on it."""
    handler = type("LedgerMetricsHandler", (_Handler,), {"registry": registry_of(ledger)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def serve_metrics(settings: Settings, host: str = "127.0.0.1", port: int = 9108) -> None:
    """Serve ``/metrics`` until interrupted."""
    server = make_server(Ledger.from_settings(settings), host, port)
    bound_host, bound_port = server.server_address[:2]
    log.info("metrics on http://%s:%s/metrics (ledger %s)", bound_host, bound_port,
             masked_url(settings.redis_url))
    try:
        server.serve_forever()
    finally:
        server.server_close()
