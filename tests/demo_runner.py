"""How the tests run a demo: as an operator would, in a session of its own.

On a timeout the whole group gets SIGTERM, so the demo stops its servers and workers as on
an operator's Ctrl-C. Killing only the process started (``make``) would leave the demo under
it running, with its SGLang or vLLM.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from cli.stack import REPO


def demo_env() -> dict[str, str]:
    """This environment without the operator's DATAGEN_ settings: the demo sets its own."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")}


def run_demo(argv: list[str], timeout_s: float,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(argv, cwd=REPO, env=demo_env() if env is None else env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def assert_agent_turns(work: Path, records: list[dict[str, Any]]) -> int:
    """The demo's agent trajectories went through: each prompt is the demo template's
    rendering of the history with the record's tools, as the demo's server renders that chat
    request, many of them ending on a tool result. Returns how many agent records there were."""
    from config.settings import load_settings
    from datagen.tokenization.chat import ChatEncoder

    kind = load_settings(work / "datagen.toml", env={}).server_kind
    encoder = ChatEncoder(work / "tokenizer", server_kind=kind)
    agent = [r for r in records if r["dataset"] == "C1_agent"]
    assert agent and all(r["tools"] for r in agent if not r["id"].startswith("glaive"))
    for rec in agent:
        assert rec["prompt_ids"] == encoder.encode(rec["messages"], rec.get("tools"))
    assert sum(r["messages"][-1]["role"] == "tool" for r in agent) >= len(agent) // 2
    return len(agent)
