"""`make demo EXTRACT=vllm` on a real vLLM (the CPU build): extraction through a vLLM engine.
(`make demo SERVER=vllm`: test_demo_vllm_capture.py, a module of its own so that `--dist
loadscope` may run the two long demos side by side.)"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from demo_runner import run_demo
from vllm_fixture import vllm_python


@pytest.mark.timeout(1500)
@pytest.mark.usefixtures("cpu_hog")
def test_make_demo_extracts_on_vllm(tmp_path: Path) -> None:
    vllm_python()  # skips (fails in CI) without .venv-vllm
    work = tmp_path / "demo"
    result = run_demo(["make", "demo", "EXTRACT=vllm", f"ARGS=--workdir {work}"], timeout_s=1400)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "through a real vLLM engine" in result.stdout
    assert "demo finished" in result.stdout and "specforge train" in result.stdout
    folder = work / "output" / "training" / "hidden_states"
    meta = json.loads((folder / "extraction.json").read_text())
    assert meta["backend"] == "vllm" and len(set(meta["aux_layer_ids"])) == 3
    files = sorted(folder.rglob("data_*.ckpt"))
    manifest = [json.loads(x) for p in (folder / "manifest").glob("*.jsonl")
                for x in p.read_text().splitlines()]
    assert files and len(files) == len(manifest)
    data = torch.load(files[0], weights_only=True)
    assert data["hidden_state"].dtype == torch.bfloat16  # the demo's extract_dtype
    assert data["aux_hidden_state"].shape[-1] == 3 * data["hidden_state"].shape[-1]
    assert (folder / "vocab_mapping.pt").is_file()
    # the engine's log is kept beside the files, the engine itself is gone
    assert list((folder / "logs").glob("vllm-*.log"))
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(work / "model") not in ps
