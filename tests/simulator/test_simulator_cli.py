"""`python -m simulator` as a separate process, the way the demo and benchmarks start it."""

import json
import os
import signal
import subprocess
import sys

import requests
from simharness import ROOT, TIMEOUT

SECRET = "sim-secret-7f3a"


def _start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "simulator", "--host", "127.0.0.1", "--port", "0", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_cli_prints_ready_line_serves_and_stops_on_sigterm(tmp_path):
    log_path = tmp_path / "requests.jsonl"
    proc = _start("--time-scale", "0.01", "--lengths", "fixed:9", "--api-key", SECRET,
                  "--request-log", str(log_path), "--log-level", "info")
    try:
        ready = proc.stdout.readline().split()
        assert ready[0] == "SIMULATOR_READY" and ready[1].startswith("http://127.0.0.1:")
        url = ready[1]
        resp = requests.post(f"{url}/generate", json={"input_ids": [1, 2], "rid": "cli-1"},
                             headers={"Authorization": f"Bearer {SECRET}"}, timeout=TIMEOUT)
        assert resp.status_code == 200
        assert resp.json()["meta_info"]["completion_tokens"] == 9
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 0, stderr
    assert "SIMULATOR_READY" not in stderr and "listening on" in stderr
    assert SECRET not in stderr
    events = [json.loads(line)["event"] for line in log_path.read_text().splitlines()]
    assert events == ["start", "finish"]


def test_cli_refuses_a_bad_setting_naming_it():
    proc = _start("--lengths", "gaussian")
    _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 2
    assert "lengths" in stderr and "gaussian" in stderr


def test_cli_takes_the_context_length_and_the_prefix_abort_as_options():
    proc = _start("--context-length", "512", "--abort-by-prefix", "true")
    try:
        url = proc.stdout.readline().split()[1]
        server = requests.get(f"{url}/server_info", timeout=TIMEOUT).json()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
    assert server["context_length"] == 512 and server["abort_by_prefix"] is True
    assert server["max_req_input_len"] == 506
