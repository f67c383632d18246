"""One real SGLang server per test run, shared by every pytest-xdist process.

A server takes 1-3 minutes and ~4 GB to start on 2 cores, so the suite starts each kind once:
the first process that needs it builds the tiny model and launches it under a file lock in the
run's folder (``$DATAGEN_TEST_RUN_DIR``, made by the controlling pytest process before its
workers start, so all of them see it), writes its URL and PID there, and every process waits
for ``/health`` 200. The controlling process stops every server by its PID when the run ends
(``stop_all``), whichever process started it. Nothing stands in for SGLang here.

When the whole suite or the real-server tests are run, the controller launches the default
server at once (``wants_real_sglang``), so its start-up overlaps the other tests.

While working on these tests, ``export DATAGEN_TEST_RUN_DIR=/some/folder`` keeps the servers
between pytest runs: a folder given from outside is not the run's to clean up, so its servers
stay up and the next run finds them (stop them with ``kill -- -<pid>``, the PID in
``sglang-*.json``).
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cli import sglang, sglang_log
from datagen.client import rid_prefix

RUN_DIR_ENV = "DATAGEN_TEST_RUN_DIR"
REAL_TESTS = Path(__file__).resolve().parent / "real_sglang"


@dataclass(frozen=True)
class RealServer:
    """A running real SGLang server: its URL, PID, log and request log folder."""

    name: str
    url: str
    pid: int
    log: Path
    request_log_dir: Path
    model_dir: Path
    context_length: int | None
    health_codes: list[int] = field(default_factory=list)  # what /health answered on the way

    def alive(self) -> bool:
        return _alive(self.pid)

    def request_log(self) -> list[dict]:
        """The server's own request log (``--log-requests``, JSON lines)."""
        return sglang_log.request_rows(self.request_log_dir)

    def served(self, dataset: str) -> dict[str, sglang_log.Served]:
        """rid -> what the server did with it, for every request of ``dataset`` it
        received. The servers are shared by every test of a run (and by every process with
        a kept run folder), so each test names its dataset uniquely (``unique_dataset``):
        every rid starts with its dataset's prefix."""
        return sglang_log.served(self.request_log(), rid_prefix(dataset))

    def disconnected(self) -> set[str]:
        """The rids the server aborted itself because their client went away."""
        return sglang_log.disconnected(self.log)

    def decoding(self, dataset: str, rids: set[str]) -> set[str]:
        """Those of ``rids`` the server received and has not ended."""
        return sglang_log.decoding(self.served(dataset), rids, self.disconnected())

    def logged(self, event: str, rid: str) -> bool:
        """Whether the request log has ``event`` ("request.received", "request.finished")
        for ``rid``."""
        return any(r.get("event") == event and r.get("rid") == rid for r in self.request_log())


def unique_dataset(stem: str) -> str:
    """A dataset name no other test or run on the shared servers uses."""
    return f"{stem}_{uuid.uuid4().hex[:8]}"


def run_dir() -> Path:
    return Path(os.environ[RUN_DIR_ENV])


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def skip_or_fail(reason: str) -> None:
    """A host that cannot run SGLang skips with one line; in CI that is a failure."""
    if in_ci():
        pytest.fail(f"CI must run the real-SGLang tests: {reason}", pytrace=False)
    pytest.skip(f"real SGLang unavailable: {reason}")


def wants_real_sglang(args: list[str], rootdir: Path) -> bool:
    """True when the run's paths include the real-server tests (no paths: the suite)."""
    if os.environ.get("DATAGEN_REAL_SGLANG") == "0" or sglang.unavailable_reason():
        return False
    paths = [Path(a.split("::")[0]) for a in args if not a.startswith("-")]
    if not paths:
        return True
    for path in paths:
        resolved = (path if path.is_absolute() else rootdir / path).resolve()
        if resolved == REAL_TESTS or REAL_TESTS in resolved.parents or \
                resolved in REAL_TESTS.parents:
            return True
    return False


@contextmanager
def _locked(name: str) -> Iterator[None]:
    with open(run_dir() / f"{name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _model() -> Path:
    where = run_dir() / "sglang-model"
    with _locked("sglang-model"):
        if not (where / "model" / "config.json").is_file():
            sglang.build_model(where)
    return where / "model"


def launch(name: str, context_length: int | None = None,
           watched: bool = False) -> tuple[RealServer, bool]:
    """The run's server called ``name``, launched now unless some process did already;
    and whether this call launched it. ``watched``: the launcher will record what /health
    answers during the start-up."""
    state = run_dir() / f"sglang-{name}.json"
    launched = False
    with _locked(f"sglang-{name}"):
        if state.is_file() and not _alive(json.loads(state.read_text())["pid"]):
            state.unlink()  # a server of an earlier run in a kept folder, gone since
        if not state.is_file():
            model = _model()
            requests_dir = run_dir() / f"sglang-{name}-requests"
            requests_dir.mkdir(exist_ok=True)
            proc, url = sglang.start_sglang(model, run_dir() / "logs", f"sglang-{name}",
                                            context_length, requests_dir)
            state.write_text(json.dumps({
                "name": name, "url": url, "pid": proc.pid, "log": str(proc.log_path),
                "request_log_dir": str(requests_dir), "model_dir": str(model),
                "context_length": context_length, "watched": watched}))
            launched = True
        info = json.loads(state.read_text())
    info.pop("watched", None)
    return RealServer(**{**info, "log": Path(info["log"]), "model_dir": Path(info["model_dir"]),
                         "request_log_dir": Path(info["request_log_dir"])}), launched


def healthy(name: str, context_length: int | None = None) -> RealServer:
    """The run's server ``name``, healthy; skipped (failed in CI) where SGLang cannot run."""
    reason = sglang.unavailable_reason()
    if reason:
        skip_or_fail(reason)
    server, launched = launch(name, context_length, watched=True)
    # Only the launcher saw the start-up; it leaves what /health answered for the others.
    seen = run_dir() / f"sglang-{name}.health.json"
    codes: list[int] = []
    sglang.wait_healthy(server.url, server.alive, server.log, codes=codes)
    if launched:
        seen.write_text(json.dumps(codes))
    state = json.loads((run_dir() / f"sglang-{name}.json").read_text())
    deadline = time.monotonic() + (60 if state.get("watched") else 0)
    while not seen.is_file() and time.monotonic() < deadline:
        time.sleep(0.1)  # the launcher saw 200 too and is writing it
    codes = json.loads(seen.read_text()) if seen.is_file() else []
    return RealServer(**{**server.__dict__, "health_codes": codes})


def stop_all(where: Path) -> None:
    """Stop every server of the run by its PID (its whole process group), SIGKILL after 30 s."""
    pids = [json.loads(p.read_text())["pid"] for p in where.glob("sglang-*.json")
            if not p.name.endswith(".health.json")]
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is not alive either
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False
