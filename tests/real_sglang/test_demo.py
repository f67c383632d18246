"""``make demo SERVER=sglang``: the demo's pipeline with a real SGLang in place of the simulator.

The command make runs (``datagen demo --server sglang``) is run directly: make would first
check both virtualenvs, which the suite has already.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from demo_runner import assert_agent_turns, run_demo
from sglang_fixture import skip_or_fail

from cli import sglang, sglang_log
from datagen.generation.records import iter_records


@pytest.mark.slow
@pytest.mark.timeout(2400)  # a real server's start-up alone took 8 min on a loaded 2-core host
def test_the_demo_generates_with_a_real_sglang_and_extracts(tmp_path: Path) -> None:
    if sglang.unavailable_reason():
        skip_or_fail(str(sglang.unavailable_reason()))
    work = tmp_path / "demo"
    result = run_demo([sys.executable, "-m", "cli.main", "demo", "--server", "sglang",
                       "--workdir", str(work)], timeout_s=2300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "SGLang healthy" in result.stdout and "demo finished" in result.stdout, out[-3000:]

    # Every stored record is an answer of the real server to that rid, at the demo's caps
    records = [r for folder in sorted((work / "output" / "records").iterdir())
               for r in iter_records(folder) if isinstance(r, dict)]
    assert records, out[-2000:]
    rows = sglang_log.request_rows(work / "sglang-requests")
    answered = sglang_log.served(rows, "")
    for rec in records:
        seen = answered[rec["rid"]]
        assert seen.normal and seen.completion_tokens == rec["completion_tokens"], rec["rid"]
        assert seen.max_new_tokens <= 32
    # ... the agent trajectories (tools, calls, results) among them, prompts as rendered
    assert assert_agent_turns(work, records) == 24
    # ... some datasets closed by their budget, and extraction wrote SpecForge's files
    assert "closed by budget: none" not in result.stdout
    hidden = work / "output" / "training" / "hidden_states"
    assert list(hidden.rglob("data_*.ckpt")), out[-2000:]
    aux = json.loads((hidden / "extraction.json").read_text())["aux_layer_ids"]
    assert len(set(aux)) == 3, aux
