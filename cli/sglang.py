"""A real SGLang server on this machine, for the tests and ``make demo SERVER=sglang``.

SGLang 0.5.23 serves a tiny random Llama on a CPU-only machine (measured: start-up 1-3 min
on 2 cores, ~4 GB of RSS, ~200 tokens/s for one request). It lives in a virtualenv of its
own (``make sglang-env``: ~10.6 GB, its own torch and transformers), so it never constrains
the project's. Two things make it run without CUDA:

- ``SGLANG_USE_CPU_ENGINE=1``, without which it looks for a GPU;
- an empty ``common_ops`` module on ``PYTHONPATH`` (``cli/sglang_cpu/``): PyPI's
  ``sglang-kernel`` holds CUDA ops only, so its ``sgl_kernel.common_ops`` fails to import on
  a CPU; with the empty one it imports and SGLang falls back to torch-native ops.

The server is launched as SGLang's own examples do, without ``--context-length`` unless asked,
so what the pipeline reads from it is what a default-launched server answers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import requests

from cli.stack import REPO, Process
from datagen.redis_server import free_port

SGLANG_PYTHON_ENV = "DATAGEN_SGLANG_PYTHON"
SGLANG_VERSION = "0.5.23"
DEFAULT_VENV = REPO / ".venv-sglang"
CPU_SHIM = REPO / "cli" / "sglang_cpu"
# Without it SGLang sizes its KV cache from free memory (13 GB here); 32,768 tokens are
# what a tiny model's tests need.
MAX_TOTAL_TOKENS = 32768


def sglang_python() -> Path:
    """The interpreter of SGLang's virtualenv: $DATAGEN_SGLANG_PYTHON, else .venv-sglang's."""
    return Path(os.environ.get(SGLANG_PYTHON_ENV) or DEFAULT_VENV / "bin" / "python")


def unavailable_reason() -> str | None:
    """None when a real SGLang can be started here, else one line saying why not."""
    python = sglang_python()
    if not python.exists():
        return (f"no SGLang virtualenv at {python} (make sglang-env installs sglang=="
                f"{SGLANG_VERSION}; {SGLANG_PYTHON_ENV} names another interpreter)")
    version = python.parent.parent / "lib"
    if not any(version.glob("python3*/site-packages/sglang")):
        return f"{python} has no sglang package (make sglang-env)"
    return None


def launch_argv(model_dir: Path, port: int, context_length: int | None = None,
                request_log_dir: Path | None = None, extra: Sequence[str] = ()) -> list[str]:
    argv = [str(sglang_python()), "-m", "sglang.launch_server", "--model-path", str(model_dir),
            "--device", "cpu", "--host", "127.0.0.1", "--port", str(port),
            "--max-total-tokens", str(MAX_TOTAL_TOKENS),
            # no core spun while idle: a CPU-only host's cores are what the tests and workers
            # beside it need. The warm-up request stays, as in a default launch: /health
            # answers 503 until it is done, which is what a client must wait out.
            "--sleep-on-idle"]
    if context_length is not None:
        argv += ["--context-length", str(context_length)]
    if request_log_dir is not None:
        argv += ["--log-requests", "--log-requests-level", "1", "--log-requests-format",
                 "json", "--log-requests-target", str(request_log_dir)]
    return argv + list(extra)


def cpu_env() -> dict[str, str]:
    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CPU_SHIM), env.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def start_sglang(model_dir: Path, log_dir: Path, name: str = "sglang",
                 context_length: int | None = None, request_log_dir: Path | None = None,
                 extra: Sequence[str] = ()) -> tuple[Process, str]:
    """Start ``sglang.launch_server`` on a free loopback port; returns at once with
    (process, base URL): the port listens long before the model is loaded, so wait with
    ``wait_healthy``."""
    port = free_port()
    argv = launch_argv(model_dir, port, context_length, request_log_dir, extra)
    proc = Process(name, argv, log_dir / f"{name}.log", cpu_env())
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(url: str, alive: Callable[[], bool], log_path: Path,
                 timeout_s: float = 900.0, codes: list[int] | None = None,
                 name: str = "SGLang") -> float:
    """Until ``GET /health`` answers 200 (it answers 503 while the model loads); returns the
    seconds waited, and appends each status it answered on the way to ``codes``. Raises
    with the log's tail when the server (``name``: SGLang, vLLM) exits or the time is up."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            status = requests.get(f"{url}/health", timeout=5).status_code
        except requests.RequestException:
            status = None
        if status is not None and codes is not None and (not codes or codes[-1] != status):
            codes.append(status)
        if status == 200:
            return time.monotonic() - started
        if not alive():
            raise RuntimeError(f"{name} exited before it was healthy:\n{_tail(log_path)}")
        time.sleep(0.5)
    raise RuntimeError(f"{name} not healthy after {timeout_s:.0f}s:\n{_tail(log_path)}")


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def build_model(where: Path) -> Path:
    """The tiny random Llama the demo extracts from, with the tiny chat tokenizer, built
    locally (nothing is downloaded): what the real server serves in the tests."""
    from datagen.builders.tiny_model import build_tiny_llama  # noqa: PLC0415 (torch)
    from datagen.tokenization.tokenizer import build_tiny_tokenizer  # noqa: PLC0415

    tokenizer = build_tiny_tokenizer(where / "tokenizer")
    from transformers import AutoTokenizer  # noqa: PLC0415

    vocab = len(AutoTokenizer.from_pretrained(tokenizer))
    return build_tiny_llama(where / "model", vocab, num_layers=4, tokenizer_dir=tokenizer)
