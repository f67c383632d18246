"""The client's router fallbacks against router shapes the tests do not run for real.

`tests/test_router.py` runs sglang-router 0.3.2 (`GET /workers`). Older routers list their
servers at `GET /list_workers` as `{"urls": [...]}`, and a data-parallel router names each
rank `<url>@<rank>`; a stand-in router answers in those shapes here, in front of a real
simulator.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
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
    wait_until(lambda: any(e["event"] == "start" for e in stack.sim_log()), 30,
               what="the request to start")

    # When: it is aborted through the router, which has no /abort_request
    client.abort(rid)
    thread.join(30)

    # Then: the server aborted it; the server list was read once for both calls
    assert [e["rid"] for e in stack.sim_log() if e["event"] == "abort"] == [rid]
    assert LegacyRouter.calls.count("/list_workers") == 1

