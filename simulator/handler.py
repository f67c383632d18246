"""HTTP plumbing: routing, the API key, JSON and chunked event-stream writing, socket resets."""

import hmac
import json
import logging
import os
import socket
import struct
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from simulator import info, vllm
from simulator.app import App
from simulator.errors import ApiError
from simulator.generate import handle_generate

logger = logging.getLogger(__name__)

# Paths that answer without the API key: SGLang leaves /health open for probes, and /_sim/ is
# the test harness's own door, not part of the server being imitated.
_OPEN_PATHS = ("/health",)
_OPEN_PREFIX = "/_sim/"


class SimHandler(BaseHTTPRequestHandler):
    # HTTP/1.1 keeps connections alive between requests of a requests.Session.
    protocol_version = "HTTP/1.1"
    server_version = "sglang-simulator"

    @property
    def app(self) -> App:
        return self.server.app  # type: ignore[attr-defined]

    def setup(self) -> None:
        super().setup()
        # Stream chunks are small writes; without NODELAY each waits for the previous ACK.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connection_opened(self.connection)  # type: ignore[attr-defined]

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:
            pass
        finally:
            self.server.connection_closed(self.connection)  # type: ignore[attr-defined]

    def do_GET(self) -> None:  # noqa: N802 (name fixed by BaseHTTPRequestHandler)
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        logger.debug("%s " + format, self.address_string(), *args)

    # --- the Responder interface used by simulator.generate ---

    def send_json(self, status: int, payload: object) -> None:
        data = json.dumps(payload).encode()
        self._send_head(status, "application/json", len(data))
        self.wfile.write(data)

    def send_empty(self, status: int) -> None:
        self._send_head(status, None, 0)

    def send_partial_then_reset(self, status: int, payload: object) -> None:
        data = json.dumps(payload).encode()
        self._send_head(status, "application/json", len(data))
        self.wfile.write(data[: len(data) // 2])
        self.reset_connection()

    def reset_connection(self) -> None:
        """Drop the socket with a TCP RST (SO_LINGER 0), so the client sees a reset."""
        self.close_connection = True
        sock = self.connection
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            # detach() + os.close closes the descriptor now, even though rfile/wfile still
            # hold references that would otherwise postpone socket.close().
            os.close(sock.detach())
        except OSError:
            logger.debug("socket already gone while resetting it")

    def start_stream(self) -> None:
        self._head_sent = True
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%X\r\n%s\r\n" % (len(data), data))

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")

    # --- internals ---

    def _send_head(self, status: int, content_type: str | None, length: int) -> None:
        self._head_sent = True
        self.send_response(status)
        if content_type:
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(length))
        self.end_headers()

    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path
        self._head_sent = False
        try:
            raw = self._read_body()
            routes = self.routes()
            route = routes.get((method, path))
            if route is None:
                self._no_route(path)
            elif not self._authorized(path):
                self.send_json(HTTPStatus.UNAUTHORIZED, {"error": "Unauthorized"})
            else:
                route(self, raw)
        except ApiError as err:
            self.send_json(err.status, err.body())
        except OSError as exc:
            logger.debug("connection error on %s %s: %s", method, path, exc)
            self.close_connection = True
        except Exception:
            logger.exception("unexpected error on %s %s", method, path)
            self.close_connection = True
            if not self._head_sent:
                self.send_json(HTTPStatus.INTERNAL_SERVER_ERROR,
                               {"error": {"message": "Internal simulator error"}})

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def routes(self) -> dict[tuple[str, str], Callable[["SimHandler", bytes], None]]:
        return VLLM_ROUTES if self.app.config.kind == "vllm" else ROUTES

    def _no_route(self, path: str) -> None:
        if any(p == path for _, p in self.routes()):
            self.send_json(HTTPStatus.METHOD_NOT_ALLOWED, {"detail": "Method Not Allowed"})
        else:
            self.send_json(HTTPStatus.NOT_FOUND, {"detail": "Not Found"})

    def _authorized(self, path: str) -> bool:
        key = self.app.config.api_key
        if key is None or path in _OPEN_PATHS or path.startswith(_OPEN_PREFIX):
            return True
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {key}".encode())


def _json_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"{}")
    except ValueError as exc:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"Invalid JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "The request body must be a JSON object.")
    return body


def _health(h: SimHandler, _raw: bytes) -> None:
    # SGLang answers 503 with an empty body while it starts (ServerStatus.Starting).
    h.send_empty(HTTPStatus.SERVICE_UNAVAILABLE if h.app.starting() else HTTPStatus.OK)


def _health_generate(h: SimHandler, _raw: bytes) -> None:
    down = h.app.starting() or h.app.fault.is_down()
    h.send_empty(HTTPStatus.SERVICE_UNAVAILABLE if down else HTTPStatus.OK)


def _model_info(h: SimHandler, _raw: bytes) -> None:
    h.send_json(HTTPStatus.OK, info.model_info(h.app.config))


def _server_info(h: SimHandler, _raw: bytes) -> None:
    running, waiting = h.app.engine.load()
    h.send_json(HTTPStatus.OK, info.server_info(h.app.config, running, waiting))


def _models(h: SimHandler, _raw: bytes) -> None:
    h.send_json(HTTPStatus.OK, info.models_list(h.app.config, h.app.started_at))


def _generate(h: SimHandler, raw: bytes) -> None:
    handle_generate(h, h.app, raw)


def _abort_request(h: SimHandler, raw: bytes) -> None:
    body = _json_body(raw)
    rid = body.get("rid")
    count = h.app.engine.abort(rid if isinstance(rid, str) else None,
                               abort_all=bool(body.get("abort_all")),
                               exact=not h.app.config.abort_by_prefix)
    logger.info("abort_request rid=%r abort_all=%s: %d aborted", rid, body.get("abort_all"), count)
    h.send_empty(HTTPStatus.OK)


def _sim_log(h: SimHandler, _raw: bytes) -> None:
    h.send_json(HTTPStatus.OK, h.app.journal.records())


def _sim_stats(h: SimHandler, _raw: bytes) -> None:
    h.send_json(HTTPStatus.OK, h.app.stats_snapshot())


def _sim_fault_get(h: SimHandler, _raw: bytes) -> None:
    h.send_json(HTTPStatus.OK, h.app.fault.describe())


def _sim_fault_set(h: SimHandler, raw: bytes) -> None:
    h.send_json(HTTPStatus.OK, h.app.fault.set(_json_body(raw)))


def _sim_reset(h: SimHandler, _raw: bytes) -> None:
    h.app.reset_observations()
    h.send_empty(HTTPStatus.OK)


def _vllm_generate(h: SimHandler, raw: bytes) -> None:
    vllm.handle_generate(h, h.app, raw)


def _vllm_abort(h: SimHandler, raw: bytes) -> None:
    vllm.handle_abort(h, h.app, raw)


def _vllm_models(h: SimHandler, _raw: bytes) -> None:
    h.send_json(HTTPStatus.OK, vllm.models_list(h.app.config, h.app.started_at))


def _vllm_version(h: SimHandler, _raw: bytes) -> None:
    h.send_json(HTTPStatus.OK, vllm.version())


SIM_ROUTES: dict[tuple[str, str], Callable[[SimHandler, bytes], None]] = {
    ("GET", "/_sim/log"): _sim_log,
    ("GET", "/_sim/stats"): _sim_stats,
    ("GET", "/_sim/fault"): _sim_fault_get,
    ("POST", "/_sim/fault"): _sim_fault_set,
    ("POST", "/_sim/reset"): _sim_reset,
}
ROUTES: dict[tuple[str, str], Callable[[SimHandler, bytes], None]] = {
    ("GET", "/health"): _health,
    ("GET", "/health_generate"): _health_generate,
    ("GET", "/model_info"): _model_info,
    ("GET", "/get_model_info"): _model_info,
    ("GET", "/server_info"): _server_info,
    ("GET", "/get_server_info"): _server_info,
    ("GET", "/v1/models"): _models,
    ("POST", "/generate"): _generate,
    ("POST", "/abort_request"): _abort_request,
    **SIM_ROUTES,
}
# --kind vllm: vLLM 0.32's routes the pipeline uses (simulator/vllm.py)
VLLM_ROUTES: dict[tuple[str, str], Callable[[SimHandler, bytes], None]] = {
    ("GET", "/health"): _health,
    ("GET", "/version"): _vllm_version,
    ("GET", "/v1/models"): _vllm_models,
    ("POST", "/inference/v1/generate"): _vllm_generate,
    ("POST", "/inference/v1/abort_requests"): _vllm_abort,
    **SIM_ROUTES,
}
