"""A Prometheus endpoint over the ledger: per-dataset gauges and per-server request latency.

The text exposition format is written here by hand (a dozen lines) so the endpoint needs no
dependency beyond the standard library. Every scrape reads the ledger afresh; nothing is
cached, so several metrics processes may serve the same run.

Per-server latency comes from three hashes keyed by the server's URL (password masked),
bumped once per committed request by ``record_request``. They add up forever, like
Prometheus counters: rate(sum)/rate(count) is the mean latency over any window.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import redis

from config.settings import Settings, masked_url
from datagen import keys
from datagen.generation.ledger import Ledger

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# HASH server -> requests committed / seconds they took end to end / completion tokens.
# No TTL. They belong in datagen/keys.py with every other key once the writer is wired.
SERVER_REQUESTS = keys.SERVER_REQUESTS
SERVER_LATENCY_S = keys.SERVER_LATENCY_S
SERVER_TOKENS = keys.SERVER_TOKENS

# (name, help, snapshot -> value) of the per-dataset gauges.
DATASET_GAUGES: list[tuple[str, str, Any]] = [
    ("datagen_tokens", "Tokens committed against the budget (the budget measure).",
     lambda s: s["tokens"]),
    ("datagen_budget_tokens", "The dataset's token budget.", lambda s: s["budget"]),
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


def render_metrics(ledger: Ledger) -> str:
    """The whole exposition: ``datagen_ledger_up 0`` alone when Redis cannot be read."""
    up_help = "1 when the ledger could be read from Redis."
    try:
        names = ledger.datasets()
        body = _dataset_metrics(ledger, names) + _server_metrics(ledger, names)
    except redis.exceptions.RedisError as exc:
        log.warning("metrics: cannot read the ledger: %s", type(exc).__name__)
        return "".join(_family("datagen_ledger_up", "gauge", up_help, [({}, 0)]))
    return "".join(_family("datagen_ledger_up", "gauge", up_help, [({}, 1)]) + body)


def _dataset_metrics(ledger: Ledger, names: list[str]) -> list[str]:
    snaps = [ledger.snapshot(name) for name in names]
    lines: list[str] = []
    for metric, text, value in DATASET_GAUGES:
        lines += _family(metric, "gauge", text,
                         [({"dataset": s["dataset"]}, value(s)) for s in snaps])
    return lines


def _server_metrics(ledger: Ledger, names: list[str]) -> list[str]:
    with ledger.r.pipeline(transaction=False) as pipe:
        pipe.hgetall(SERVER_REQUESTS)
        pipe.hgetall(SERVER_LATENCY_S)
        pipe.hgetall(SERVER_TOKENS)
        for name in names:
            pipe.hvals(ledger.k(name, keys.INFLIGHT))
        counts, seconds, tokens, *in_flight = pipe.execute()
    servers = sorted(counts)
    lines = _summary("datagen_request_latency_seconds",
                     "End-to-end /generate latency of committed requests, per server.",
                     [({"server": s}, float(seconds.get(s, 0)), int(counts[s]))
                      for s in servers])
    lines += _family("datagen_server_completion_tokens_total", "counter",
                     "Completion tokens of committed requests, per server.",
                     [({"server": s}, int(tokens.get(s, 0))) for s in servers])
    by_server = _in_flight_by_server(in_flight)
    lines += _family("datagen_server_in_flight", "gauge",
                     "Requests in flight, per server (from the ledger's leases).",
                     [({"server": s}, by_server[s]) for s in sorted(by_server)])
    return lines


def _in_flight_by_server(entries_per_dataset: Iterable[list[str]]) -> Counter[str]:
    by_server: Counter[str] = Counter()
    for entries in entries_per_dataset:
        for raw in entries:
            by_server[masked_url(json.loads(raw).get("server") or "unknown")] += 1
    return by_server


def _summary(name: str, text: str,
             samples: Iterable[tuple[dict[str, str], float, int]]) -> list[str]:
    """A summary without quantiles: _sum and _count per label set."""
    lines = [f"# HELP {name} {text}\n", f"# TYPE {name} summary\n"]
    for labels, total, count in samples:
        lines.append(f"{name}_sum{_labels(labels)} {_number(total)}\n")
        lines.append(f"{name}_count{_labels(labels)} {count}\n")
    return lines


def _family(name: str, kind: str, text: str,
            samples: Iterable[tuple[dict[str, str], float]]) -> list[str]:
    lines = [f"# HELP {name} {text}\n", f"# TYPE {name} {kind}\n"]
    for labels, value in samples:
        lines.append(f"{name}{_labels(labels)} {_number(value)}\n")
    return lines


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class _Handler(BaseHTTPRequestHandler):
    ledger: Ledger  # set on the subclass make_server builds

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.split("?", 1)[0] != "/metrics":
            self._send(404, "text/plain; charset=utf-8", b"try /metrics\n")
            return
        self._send(200, CONTENT_TYPE, render_metrics(self.ledger).encode("utf-8"))

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("metrics %s: " + format, self.address_string(), *args)


def make_server(ledger: Ledger, host: str = "127.0.0.1", port: int = 9108
                ) -> ThreadingHTTPServer:
    """A bound server (port 0 picks a free one); call ``serve_forever`` on it."""
    handler = type("MetricsHandler", (_Handler,), {"ledger": ledger})
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
