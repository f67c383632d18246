"""How this project starts and stops every vLLM: the extraction engine (the `vllm` backend),
the generation server of ``SERVER=vllm``, and the tests' and benchmarks' servers. Standard
library only, so that what launches vLLM imports no torch."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

CPU_KV_CACHE_GIB = "2"

# The process-group keeper: the session leader of the server's group. It ends the whole group
# when the process that started it dies (SIGTERM from PR_SET_PDEATHSIG), when asked (SIGTERM),
# or when the server exits by itself. Standard library only (it runs in vLLM's environment).
LAUNCHER = r"""
import ctypes, os, signal, subprocess, sys
def end(*_):
    os.killpg(0, signal.SIGKILL)
signal.signal(signal.SIGTERM, end)
ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    end()
server = subprocess.Popen(sys.argv[2:])
code = server.wait()
print(f"vLLM server exited with {code}", file=sys.stderr, flush=True)
end()
"""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def repo_root() -> str:
    """The folder holding the `datagen` package: the engine imports the connector from it."""
    return str(Path(__file__).resolve().parents[2])


def engine_env() -> dict[str, str]:
    """The environment of every vLLM this project starts (the `vllm` backend's engine, the
    generation server of `SERVER=vllm`, the tests' and the bench's): the connector importable
    from this checkout, log lines as they come (not in blocks: tests and operators wait on
    them), and on the CPU build a KV cache of CPU_KV_CACHE_GIB unless the operator sets
    one (vLLM's own default reserves 92% of the host's memory and refuses to start beside
    anything else; GPU builds ignore the variable)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root(), env.get("PYTHONPATH")) if p)
    return env


def stop_group(proc: subprocess.Popen) -> None:
    """SIGKILL a vLLM started under LAUNCHER (its own process group: API server, engine core,
    workers) and reap the launcher; nothing to do once it has exited."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
