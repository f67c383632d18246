"""A local stack of real processes: Redis, SGLang simulators and Celery workers.

The demo, the tests and the benchmarks start the same processes an operator
does, on loopback, each with a log file, and stop them on exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import redis

from datagen import keys
from datagen.redis_server import RedisServer

REPO = Path(__file__).resolve().parent.parent

# An upper bound on waiting for a child to start, not a speed expectation: every wait below
# fails at once when the child exits, and on a loaded 2-core CI machine a worker's imports
# alone took over a minute.
START_TIMEOUT_S = 600.0


class Process:
    """A child process with its own log file, killed with its whole process group."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path,
                 env: Mapping[str, str] | None = None):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(env) if env else None, cwd=REPO,
                                     start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait()
        self._log.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def start_simulator(log_dir: Path, args: Sequence[str] = (), name: str = "simulator",
                    timeout_s: float = START_TIMEOUT_S) -> tuple[Process, str]:
    """Start ``python -m simulator`` on a free port; returns (process, base URL).

    Waits for the SIMULATOR_READY line while the process lives; fails at once if it exits.
    """
    ready = log_dir / f"{name}.ready"
    ready.unlink(missing_ok=True)
    argv = [sys.executable, "-u", "-m", "simulator", "--host", "127.0.0.1", "--port", "0",
            *args]
    proc = Process(name, argv, log_dir / f"{name}.log")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in proc.log_text().splitlines():
            if line.startswith("SIMULATOR_READY "):
                return proc, line.split()[1]
        if not proc.alive():
            raise RuntimeError(f"simulator exited:\n{proc.log_text()[-2000:]}")
        time.sleep(0.05)
    proc.stop()
    raise RuntimeError(f"simulator not ready after {timeout_s}s:\n{proc.log_text()[-2000:]}")


def start_worker(queue: str, env: Mapping[str, str], log_dir: Path, name: str | None = None,
                 extra: Sequence[str] = ()) -> Process:
    """``datagen worker QUEUE``: the same command as `make workers`."""
    node = name or f"{queue}-{os.getpid()}-{time.monotonic_ns() % 10**6}@%h"
    argv = [sys.executable, "-m", "cli.main", "worker", queue, "-n", node, *extra]
    return Process(node.split("@")[0], argv, log_dir / f"worker-{node.split('@')[0]}.log", env)


def wait_for_workers(redis_url: str, count: int, timeout_s: float = START_TIMEOUT_S,
                     procs: Sequence[Process] = ()) -> None:
    """Until ``count`` workers beat their heartbeat (they are then consuming).

    Fails at once when one of ``procs`` exits; ``timeout_s`` only bounds a start-up that
    hangs, so pass the workers being waited for.
    """
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = sum(1 for _ in client.scan_iter(match=keys.worker_alive("*")))
        if alive >= count:
            return
        for proc in procs:
            if not proc.alive():
                raise RuntimeError(f"worker {proc.name} exited:\n{proc.log_text()[-3000:]}")
        time.sleep(0.1)
    logs = "".join(f"\n--- {p.name}:\n{p.log_text()[-1500:]}" for p in procs)
    raise RuntimeError(f"{count} workers not up after {timeout_s}s{logs}")


def child_env(settings_env: Mapping[str, str]) -> dict[str, str]:
    """The environment of a child: ours plus the run's DATAGEN_* settings."""
    env = dict(os.environ)
    env.update(settings_env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


__all__ = ["START_TIMEOUT_S", "Process", "RedisServer", "child_env", "start_simulator",
           "start_worker",
           "wait_for_workers"]
