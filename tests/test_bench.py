"""The benchmark scripts run as documented (small sizes): their figures come from them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from cli.stack import REPO


def test_bench_ledger_measures_admission_and_traffic(tmp_path: Path) -> None:
    out = tmp_path / "ledger.json"
    result = subprocess.run(
        [sys.executable, "bench/bench_ledger.py", "--in-flight", "0,1000", "--calls", "30",
         "--samples", "40", "--threads", "8", "--old", "", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["in_flight"]: r for r in data["server_time"]}
    assert set(rows) == {0, 1000}
    # Buckets, not entries: a thousand requests in flight read as a few dozen fields
    assert 0 < rows[1000]["buckets"] < 100
    assert rows[1000]["admit_us"] > 0 and rows[1000]["commit_us"] > 0
    assert data["traffic"]["samples"] == 40
    assert 0 < data["traffic"]["round_trips_per_sample"] <= 4
    assert "| in flight |" in result.stdout
