"""The simulator's HTTP server: one thread per connection, one engine thread for all requests.

    url, stop = start_in_thread(SimulatorConfig(max_running_requests=4, time_scale=0.01))
"""

import dataclasses
import logging
import socket
import socketserver
import threading
from collections.abc import Callable
from http.server import ThreadingHTTPServer

from simulator.app import App
from simulator.config import SimulatorConfig
from simulator.handler import SimHandler

__all__ = ["SimulatorConfig", "SimHTTPServer", "Simulator", "start_in_thread"]

logger = logging.getLogger(__name__)


class SimHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # Hundreds of workers connect at once; the default backlog of 5 would refuse some.
    request_queue_size = 1024
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], app: App) -> None:
        self.app = app
        self._conn_lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        super().__init__(address, SimHandler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls getfqdn(), a reverse DNS lookup that can stall for
        # seconds on machines without a resolver; the name is never used here.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def connection_opened(self, sock: socket.socket) -> None:
        with self._conn_lock:
            self._connections.add(sock)
        self.app.stats.connection_opened()

    def connection_closed(self, sock: socket.socket) -> None:
        with self._conn_lock:
            if sock not in self._connections:
                return
            self._connections.discard(sock)
        self.app.stats.connection_closed()

    def close_connections(self) -> None:
        """Wake handler threads blocked on idle keep-alive sockets so they end."""
        with self._conn_lock:
            socks = list(self._connections)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class Simulator:
    """A running simulator: `url` to talk to, `stop()` to end it."""

    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        self.app = App(config)
        self.httpd = SimHTTPServer((config.host, config.port), self.app)
        host, port = self.httpd.server_address[:2]
        # /server_info reports the port actually bound, not the 0 that asked for any port.
        self.app.config = self.config = dataclasses.replace(config, port=port)
        self.url = f"http://{host}:{port}"
        self._thread: threading.Thread | None = None

    def start(self) -> "Simulator":
        self.app.start()
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1},
            name="sim-http", daemon=True,
        )
        self._thread.start()
        logger.info("simulator listening on %s (%r)", self.url, self.config)
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        # Engine first: it finishes every in-flight request, so waiting handlers answer.
        self.app.stop()
        self.httpd.close_connections()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        logger.info("simulator on %s stopped", self.url)


def start_in_thread(config: SimulatorConfig) -> tuple[str, Callable[[], None]]:
    """Start a simulator inside this process; returns (base_url, stop_fn)."""
    sim = Simulator(config).start()
    return sim.url, sim.stop
