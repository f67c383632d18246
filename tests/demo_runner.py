"""How the tests run a demo: as an operator would, in a session of its own.

On a timeout the whole group gets SIGTERM, so the demo stops its servers and workers as on
an operator's Ctrl-C. Killing only the process started (``make``) would leave the demo under
it running, with its SGLang or vLLM.
"""

from __future__ import annotations

import os
import signal
import subprocess

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
