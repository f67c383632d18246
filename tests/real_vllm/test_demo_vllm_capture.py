"""`make demo SERVER=vllm` on a real vLLM (the CPU build): generation on a vLLM server that
captures the states, and the training folder built from them with no extraction pass."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from demo_runner import assert_agent_turns, demo_env, run_demo
from vllm_fixture import vllm_python

from cli.saved import saved_ledger
from cli.stack import REPO
from config.settings import load_settings
from datagen.generation.ledger import Ledger
from datagen.servers import capture


def test_the_vllm_demo_without_vllm_says_why_in_one_line(tmp_path: Path) -> None:
    env = demo_env()
    env["DATAGEN_VLLM_PYTHON"] = str(tmp_path / "no-venv" / "bin" / "python")
    result = subprocess.run([sys.executable, "-m", "cli.main", "demo", "--server", "vllm",
                             "--workdir", str(tmp_path / "demo")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout.strip() == (
        f"demo --server vllm: no vLLM virtualenv at {env['DATAGEN_VLLM_PYTHON']} (make "
        "vllm-env installs vLLM 0.32's CPU build in .venv-vllm, ~3.0 GB; DATAGEN_VLLM_PYTHON "
        "names another interpreter)")
    assert not (tmp_path / "demo").exists()  # nothing started


@pytest.mark.timeout(1500)
@pytest.mark.usefixtures("cpu_hog")
def test_the_demo_generates_on_vllm_capturing_the_states_with_no_extraction_pass(
        tmp_path: Path) -> None:
    vllm_python()  # skips (fails in CI) without .venv-vllm
    work = tmp_path / "demo"
    # When: `make demo SERVER=vllm` runs (its virtualenvs are the suite's, already made)
    started = time.monotonic()
    result = run_demo(["make", "demo", "SERVER=vllm", f"ARGS=--workdir {work}"], timeout_s=1400)
    stdout, out = result.stdout, result.stdout + result.stderr
    took_s = time.monotonic() - started
    assert result.returncode == 0, out[-4000:]
    assert "vLLM healthy" in stdout and "demo finished" in stdout, out[-3000:]
    assert "specforge train" in stdout and "checked rows_" in stdout, out[-3000:]
    phases = next(x for x in stdout.splitlines() if x.startswith("phases: "))
    assert "no extraction forward pass ran" in phases, phases
    print(f"FIGURE demo --server vllm: {took_s:.0f} s; {phases}")

    # Then: every sample counted once, each with the states file the server wrote for it
    settings = load_settings(work / "datagen.toml", env={})
    output = work / "output"
    with saved_ledger(work / "redis" / "dump.rdb") as url:
        ledger = Ledger.from_settings(settings.replace(redis_url=url))
        stats = {d: ledger.snapshot(d)["stats"] for d in ledger.datasets()}
    assert set(stats) == {"A1_code", "A2_longdoc", "B1_chat", "B2_math", "C1_agent", "C2_think"}
    every: list[dict] = []
    for dataset, counted in stats.items():
        recs = [json.loads(x) for x in
                (output / dataset / "raw_responses.jsonl").read_text().splitlines()]
        every += recs
        assert len({r["id"] for r in recs}) == len(recs) == counted["samples"], dataset
        assert sum(r["completion_tokens"] for r in recs) == counted["tokens"], dataset
        for rec in recs:  # the build freed the file of every row it wrote (its mark stays)
            ids = rec["prompt_ids"] + rec["output_ids"][:-1]
            path = output / rec["states"]
            if capture.built_row(path) is None:  # not in the training set (overlong)
                assert capture.check_file(path, ids) == rec["states_bytes"]
            else:
                assert not path.exists()
    # ... the agent trajectories (tools, calls, results) generated on vLLM among them
    assert assert_agent_turns(work, every) == 24

    # and the training folder built from those files by `captured`: no engine, no forward
    folder = output / "training" / "hidden_states"
    meta = json.loads((folder / "extraction.json").read_text())
    assert meta["backend"] == "captured" and len(set(meta["aux_layer_ids"])) == 3
    assert not (folder / "logs").exists() or not list((folder / "logs").glob("vllm-*.log"))
    files = sorted(folder.rglob("data_*.ckpt"))
    manifest = [json.loads(x) for p in (folder / "manifest").glob("*.jsonl")
                for x in p.read_text().splitlines()]
    assert files and len(files) == len(manifest)
    # every file proved against the server's log-probabilities (check_states): each sample's
    # line names its positions and gap, and the run's total has them all, none failed
    assert all(e["checked"] > 0 and e["gap"] < 0.1 for e in manifest), manifest[:3]
    total = meta["state_check"]
    assert total["checked"] == len(manifest) and total["failed"] == total["unchecked"] == 0
    assert f"state check: {len(manifest):,} samples checked" in stdout
    data = torch.load(files[0], weights_only=True)
    assert data["hidden_state"].dtype == torch.bfloat16  # captured in float32, cast
    assert data["aux_hidden_state"].shape[-1] == 3 * data["hidden_state"].shape[-1]
    assert (folder / "vocab_mapping.pt").is_file()
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(work / "model") not in ps  # the server is gone with the demo
