"""Where the real-vLLM tests find vLLM (the CPU build `make vllm-env` installs in
.venv-vllm), and a real vLLM server for generation."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from conftest import wait_until
from sglang_fixture import in_ci

from cli import vllm as vllm_cli
from cli.stack import REPO
from datagen.servers.launch import engine_env, stop_group


def vllm_python() -> str:
    """Its Python (``cli.vllm``'s); a host without it skips with one line saying why, and in
    CI that is a failure."""
    if reason := vllm_cli.unavailable_reason():
        if in_ci():
            pytest.fail(f"CI must run the real-vLLM tests: {reason}", pytrace=False)
        pytest.skip(reason)
    return str(vllm_cli.vllm_python())


@dataclass
class GenerationServer:
    """A real vLLM OpenAI server with the token-in/token-out API, in a process group of its
    own that the launcher ends with this process (datagen/extraction/backends/vllm.py's)."""

    url: str
    proc: subprocess.Popen
    log: Path
    max_model_len: int

    def metric(self, name: str) -> float:
        """A gauge or counter of its /metrics (summed over its labels)."""
        text = requests.get(f"{self.url}/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def added(self, rid: str) -> bool:
        """Whether it runs (or ran) the request sent with ``rid``: ``--enable-log-requests``
        logs "Added request generate-tokens-<rid>-<suffix>" once an abort can find it."""
        return f"Added request generate-tokens-{rid}" in self.log.read_text(errors="replace")

    def aborted(self, rids: set[str]) -> set[str]:
        """The rids its log says it aborted (a request that ran on never logs one)."""
        log = self.log.read_text(errors="replace")
        return {r for r in rids if f"Aborted request(s) generate-tokens-{r}" in log}

    def abort_mid_decode(self, rid: str, start: Callable[[], Any], abort: Callable[[], Any],
                         tokens: int = 10) -> tuple[Any, Any]:
        """``start()`` sends the request ``rid`` with the engine frozen; the engine then runs
        in steps until it made ``tokens`` more tokens, and ``abort()`` is called while it is
        stopped: the request is surely mid-decode then, however slow or starved the machine
        (a decoding CPU engine beside other load ran a request to its cap before a test
        could abort it, in CI). Returns what each returned, once vLLM took the abort."""
        made = self.metric("vllm:generation_tokens_total")
        with self.engine_frozen() as engine:
            started = start()
            wait_until(lambda: self.added(rid), 120, 0.02, what="the request to reach vLLM")
            engine.step_until(
                lambda: self.metric("vllm:generation_tokens_total") >= made + tokens, 600,
                what=f"it to decode {tokens} tokens")
            sent = abort()
            wait_until(lambda: self.aborted({rid}), 60, 0.05, what="vLLM to take the abort")
        return started, sent

    @contextmanager
    def engine_frozen(self) -> Iterator[FrozenEngine]:
        """The engine core (every process under the API server) stopped with SIGSTOP, the API
        server left running: requests stay in flight however long the test takes, and what
        the API server is sent (an abort) waits in the engine's queue until SIGCONT. The
        engine then runs only in the steps the test lets it take (``FrozenEngine.step_until``)."""
        import psutil

        launcher = psutil.Process(self.proc.pid)
        api = next(p for p in launcher.children() if "api_server" in " ".join(p.cmdline()))
        engine = FrozenEngine(api.children(recursive=True))
        assert engine.procs, "the vLLM API server has no engine process"
        engine.stop()
        try:
            yield engine
        finally:
            engine.go()

    def stop(self) -> None:
        stop_group(self.proc)


@dataclass
class FrozenEngine:
    """vLLM's engine processes, stopped (SIGSTOP) but for the moments a test lets them run.

    A test that waits for a request to be mid-decode and then freezes the engine depends on
    the machine. On these 2-core machines a decoding CPU engine beside other load kept
    every other process that slept from waking for as long as it decoded (16-35 s, even
    with the engine at nice 19; measured 2026-12-05), so such a test saw its request end
    before it could freeze the engine. Frozen from the start and asked only while stopped,
    the engine cannot end a request unseen; each step it takes is ended by a thread at a
    real-time priority (as root, as CI runs), which wakes on time however busy the engine
    keeps the cores."""

    procs: list[Any]
    name: str = "vLLM's engine"

    @classmethod
    def group(cls, pgid: int, name: str) -> FrozenEngine:
        """Every process of the process group ``pgid`` (a worker and its children), running:
        ``stop`` and ``go`` hold and release them as one."""
        import psutil

        def in_group(pid: int) -> bool:
            try:
                return os.getpgid(pid) == pgid
            except ProcessLookupError:
                return False
        return cls([p for p in psutil.process_iter() if in_group(p.pid)], name)

    def stop(self) -> None:
        self._signal(signal.SIGSTOP)
        self._wait_stopped()

    def go(self) -> None:
        self._signal(signal.SIGCONT)

    def step_until(self, done: Callable[[], bool], timeout_s: float, what: str,
                   step_s: float = 0.05) -> None:
        """Lets the engine run ``step_s`` at a time until ``done()``, which is asked only while
        the engine is stopped; the engine is stopped when this returns."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            with _real_time():
                self.go()
                time.sleep(step_s)
                self._signal(signal.SIGSTOP)
            self._wait_stopped()

    def _signal(self, sig: signal.Signals) -> None:
        for proc in self.procs:
            proc.send_signal(sig)

    def _wait_stopped(self) -> None:
        # stopped once the kernel says so, not once the signal is sent
        wait_until(lambda: all(_stopped(p) for p in self.procs), 60, 0.005,
                   what=f"{self.name} to stop")


def _stopped(proc: Any) -> bool:
    """Stopped, or gone (a process that exited meanwhile runs no more)."""
    import psutil

    try:
        return proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


@contextmanager
def _real_time() -> Iterator[None]:
    """This thread at SCHED_FIFO for the block (as root; otherwise as it was)."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def start_generation_server(model: Path, log: Path, max_model_len: int,
                            timeout_s: float = 900.0, extra_args: Sequence[str] = ()
                            ) -> GenerationServer:
    """How DESIGN.md says to launch vLLM for generation: ``--enable-scale-out`` (the
    token API), ``--skip-tokenizer-init`` (ids in and out: no tokenizer), float32 here so
    greedy outputs equal transformers'; ready when /health answers 200. ``extra_args``:
    capture_states' (datagen.servers.capture.server_args), whose connector the server imports
    from this checkout."""
    from cli.vllm import launch_argv, launcher_argv

    vllm_python()  # skip (or fail in CI) without it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the demo's flags (cli/vllm.py, with PYTHONUNBUFFERED: the tests wait on its log lines),
    # float32, and each request's id in the log
    argv = launch_argv(model, port, max_model_len, "float32", [
        "--served-model-name", "tiny", "--enable-log-requests", "--max-log-len", "8",
        *extra_args])
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        proc = subprocess.Popen(launcher_argv(argv), stdout=fh, stderr=subprocess.STDOUT,
                                env=engine_env(), start_new_session=True)
    server = GenerationServer(f"http://127.0.0.1:{port}", proc, log, max_model_len)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"vLLM exited with {proc.returncode}: "
                                 f"{log.read_text(errors='replace')[-3000:]}")
        try:
            return requests.get(f"{server.url}/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False
    try:
        wait_until(ready, timeout_s, 0.5, what=f"vLLM on {server.url} (log {log})")
    except BaseException:
        server.stop()
        raise
    return server


def configure_on(stack: Any, server: GenerationServer, tokenizer: Path, dataset: str,
                 prompts: Sequence[tuple[str, str]], **settings: Any) -> Any:
    """A partition of one dataset (``(id, prompt)`` rows) and the stack's settings for
    generation on ``server`` (server_kind vllm, the model's own tokenizer), ``settings``
    besides; returns the Settings."""
    from conftest import write_jsonl

    part = stack.tmp / "partition"
    write_jsonl(part / f"{dataset}.jsonl", [{"id": i, "prompt": p} for i, p in prompts])
    return stack.configure(server_url=server.url, server_kind="vllm", data_dir=str(part),
                           tokenizer_path=str(tokenizer), **settings)


def datagen_run(stack: Any, timeout_s: float = 900) -> float:
    """`datagen run` (produce, then follow to the end) in a process of its own with the
    stack's settings; asserts it ended well and returns its seconds."""
    from cli.stack import child_env

    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "cli.main", "run", "--interval", "0.5"],
                            cwd=REPO, env=child_env(stack.env), capture_output=True, text=True,
                            timeout=timeout_s)
    assert result.returncode == 0, result.stderr[-3000:]
    return time.monotonic() - started
