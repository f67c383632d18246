"""The client's router fallbacks against router shapes the tests do not run for real.

`tests/test_router.py` runs sglang-router 0.3.2 (`GET /workers`). Older routers list their
servers at `GET /list_workers` as `{"urls": [...]}`, and a data-parallel router names each
rank `<url>@<rank>`; a stand-in router answers in those shapes here, in front of a real
simulator.
"""

from __future__ import annotations

import json
import math
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests
from conftest import Stack, wait_until

from datagen.client import SGLangClient, new_rid


class LegacyRouter(BaseHTTPRequestHandler):
    servers: list[str] = []
    calls: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.calls.append(self.path)
        if self.path == "/list_workers":
            self._send(200, {"urls": [f"{u}@{rank}" for u in self.servers for rank in (0, 1)]})
        else:
            self._send(404, {})

    def do_POST(self) -> None:  # noqa: N802
        self.calls.append(self.path)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send(404, {})

    def _send(self, status: int, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def legacy_router(stack: Stack) -> Iterator[str]:
    LegacyRouter.servers = [stack.start_simulator("--lengths", "fixed:4000",
                                                  "--decode-step-s", "0.01")]
    LegacyRouter.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), LegacyRouter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def test_an_abort_reaches_the_servers_an_older_router_lists(stack: Stack,
                                                            legacy_router: str) -> None:
    client = SGLangClient(legacy_router)
    # One server, listed once per data-parallel rank: asked once.
    assert client.backends() == [stack.sim_url]

    # Given: a request running on the server, sent there directly
    rid = new_rid("B1")
    direct = SGLangClient(stack.sim_url)
    thread = threading.Thread(target=direct.generate, args=([1, 2], {"max_new_tokens": 4000},
                                                            rid))
    thread.start()
    wait_until(lambda: any(e["event"] == "start" for e in stack.sim_log()), 120,
               what="the request to start")

    # When: it is aborted through the router, which has no /abort_request
    client.abort(rid)
    thread.join(30)

    # Then: the server aborted it; the server list was read once for both calls
    assert [e["rid"] for e in stack.sim_log() if e["event"] == "abort"] == [rid]
    assert LegacyRouter.calls.count("/list_workers") == 1


class ForwardProxy(BaseHTTPRequestHandler):
    """A plain HTTP proxy stand-in: requests for absolute URLs, passed on and noted."""

    seen: list[str] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.seen.append(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        upstream = requests.post(self.path, data=body, timeout=30,
                                 headers={"Content-Type": "application/json"},
                                 proxies={"http": "", "https": ""})
        self.send_response(upstream.status_code)
        self.send_header("Content-Length", str(len(upstream.content)))
        self.end_headers()
        self.wfile.write(upstream.content)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def forward_proxy() -> Iterator[str]:
    ForwardProxy.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), ForwardProxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.mark.parametrize("bypassed", [False, True], ids=["proxied", "no_proxy"])
def test_generate_honours_the_proxy_settings_of_the_environment(
        stack: Stack, forward_proxy: str, monkeypatch: pytest.MonkeyPatch,
        bypassed: bool) -> None:
    # Given: a proxy in the environment, and the server excluded from it or not
    url = stack.start_simulator("--lengths", "fixed:3", "--decode-step-s", "0.001")
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", forward_proxy)
    monkeypatch.setenv("http_proxy", forward_proxy)
    if bypassed:
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        monkeypatch.setenv("no_proxy", "127.0.0.1")

    # When: a sample is generated
    gen = SGLangClient(url).generate([1, 2, 3], {"max_new_tokens": 3}, new_rid("B1"), "B1")

    # Then: it went through the proxy exactly when the environment says so
    assert gen.completion_tokens == 3
    assert ForwardProxy.seen == ([] if bypassed else [f"{url}/generate"])


def send_json(handler: BaseHTTPRequestHandler, payload: object) -> None:
    """A 200 answer through Python's json.dumps (NaN written as a literal)."""
    data = json.dumps(payload).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class OneRequestPerConnection(BaseHTTPRequestHandler):
    """Answers one /generate per connection, then closes it without saying so: what a
    server's keep-alive timeout does to a connection left idle."""

    protocol_version = "HTTP/1.1"
    closed = threading.Semaphore(0)
    connections = 0

    def handle(self) -> None:
        type(self).connections += 1
        self.handle_one_request()

    def finish(self) -> None:
        super().finish()
        self.connection.close()
        self.closed.release()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        send_json(self, {"text": "", "output_ids": [5, 6],
                         "meta_info": {"prompt_tokens": 3, "completion_tokens": 2,
                                       "finish_reason": {"type": "stop"}}})

    def log_message(self, *args: object) -> None:
        pass


def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    # Given: a server that closes each connection after one answer, keep-alive announced
    OneRequestPerConnection.closed = threading.Semaphore(0)
    OneRequestPerConnection.connections = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), OneRequestPerConnection)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = SGLangClient(f"http://127.0.0.1:{server.server_port}")
    try:
        for i in range(3):
            # When: a sample is generated after the server closed the previous connection
            gen = client.generate([1, 2, 3], {"max_new_tokens": 2}, new_rid("B1"), "B1")
            assert OneRequestPerConnection.closed.acquire(timeout=30)
            # Then: it succeeds, on a connection of its own
            assert gen.output_ids == [5, 6]
            assert OneRequestPerConnection.connections == i + 1
    finally:
        server.shutdown()


def test_requests_waiting_on_a_lost_server_are_dropped_at_once_and_reset() -> None:
    """drop_in_flight (the heartbeat calls it when the server cannot be reached): the thread
    waiting on the answer gets ServerUnavailable now, not after read_timeout_s, and the
    connection ends with a reset (linger 0: unsent bytes are thrown away, not delivered
    later), not an orderly close."""
    import socket

    from datagen.errors import ServerUnavailable

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    got: dict[str, object] = {}
    received = threading.Event()

    def silent_server() -> None:  # reads the request, never answers
        conn, _ = listener.accept()
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        head, body = data.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += conn.recv(65536)
        received.set()
        try:
            got["after"] = conn.recv(65536)
        except ConnectionResetError as exc:
            got["after"] = exc
        conn.close()

    server = threading.Thread(target=silent_server, daemon=True)
    server.start()
    client = SGLangClient(f"http://127.0.0.1:{port}", read_timeout_s=600)

    def call() -> None:
        try:
            client.generate([1, 2, 3], {"max_new_tokens": 4}, new_rid("d"))
        except ServerUnavailable as exc:
            got["error"] = exc

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    assert received.wait(30)
    wait_until(lambda: client.drop_in_flight() == 1, 10, 0.01, what="the call dropped")
    caller.join(10)
    server.join(10)
    assert not caller.is_alive() and isinstance(got.get("error"), ServerUnavailable)
    assert isinstance(got["after"], ConnectionResetError), got["after"]
    assert client.drop_in_flight() == 0  # nothing is waiting any more
    listener.close()


@pytest.mark.parametrize(("error", "reachable"), [
    (socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"), True),
    (socket.gaierror(socket.EAI_NONAME, "Name or service not known"), True),
    (TimeoutError("timed out"), False),
    (ConnectionRefusedError(111, "Connection refused"), True)])
def test_a_resolver_that_did_not_answer_in_time_is_no_verdict_on_the_server_s_host(
        monkeypatch: pytest.MonkeyPatch, error: OSError, reachable: bool) -> None:
    # A container network's DNS (Podman's aardvark-dns) may answer EAI_AGAIN, or EAI_NONAME
    # for seconds, about a container that is up, on a loaded host: taken as "host gone", the
    # worker would end its leases and its samples would run twice (stored twice, counted
    # once: 12 of 120 in a fresh-clone CI)
    def connect(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(socket, "create_connection", connect)
    assert SGLangClient("http://sglang:30000", unresolved_grace_s=60.0).reachable() is reachable


def test_a_name_that_stays_unresolved_past_the_grace_is_a_host_gone_and_a_lookup_resets_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: a client whose server's name does not resolve (a removed container), no grace
    outcome: dict[str, BaseException] = {"error": socket.gaierror(socket.EAI_NONAME, "unknown")}

    def connect(*args: object, **kwargs: object) -> None:
        raise outcome["error"]

    monkeypatch.setattr(socket, "create_connection", connect)
    client = SGLangClient("http://sglang:30000", unresolved_grace_s=0.0)
    # Then: the host is gone at once; with a grace it would be no verdict
    assert client.reachable() is False
    # When: a lookup succeeds (the server refuses: the host is up), then fails again
    outcome["error"] = ConnectionRefusedError(111, "Connection refused")
    assert client.reachable() is True
    graced = SGLangClient("http://sglang:30000", unresolved_grace_s=3600.0)
    outcome["error"] = socket.gaierror(socket.EAI_NONAME, "unknown")
    # Then: a new run of failures starts its own grace
    assert graced.reachable() is True and graced.reachable() is True


class PythonJsonEngine(BaseHTTPRequestHandler):
    """An engine that answers through Python's json.dumps, which writes NaN and Infinity
    (orjson refuses them); it keeps the bodies it was sent."""

    bodies: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.bodies.append(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        send_json(self, {"text": "é", "output_ids": [5, 6], "meta_info": {
            "prompt_tokens": 3, "completion_tokens": 2, "e2e_latency": math.nan,
            "finish_reason": {"type": "stop", "matched": 6}}})

    def log_message(self, *args: object) -> None:
        pass


def test_an_answer_holding_nan_is_parsed_and_the_body_sent_holds_what_was_asked() -> None:
    # Given: an engine whose answer holds a NaN literal (orjson alone: "malformed response")
    PythonJsonEngine.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), PythonJsonEngine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    asked = {"max_new_tokens": 2, "stop": ["終わり"], "temperature": 0.7, "min_p": 1e-05}
    try:
        # When: a sample is generated there
        gen = SGLangClient(f"http://127.0.0.1:{server.server_port}").generate(
            [1, 2, 3], asked, "rid-1", "B1")
    finally:
        server.shutdown()

    # Then: the answer is read as json reads it, and the body carried exactly what was asked
    assert gen.output_ids == [5, 6] and gen.text == "é" and math.isnan(gen.latency_s)
    sent = json.loads(PythonJsonEngine.bodies[0])
    assert sent["input_ids"] == [1, 2, 3] and sent["rid"] == "rid-1"
    assert sent["sampling_params"] == asked
