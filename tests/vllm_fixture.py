"""Where the real-vLLM tests find vLLM: the CPU build `make vllm-env` installs in .venv-vllm."""

from __future__ import annotations

import pytest
from sglang_fixture import in_ci

from cli.stack import REPO

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def vllm_python() -> str:
    """Its Python; a host without it skips with one line, and in CI that is a failure."""
    if not VLLM_PYTHON.is_file():
        reason = f"no {VLLM_PYTHON.relative_to(REPO)}: `make vllm-env` installs vLLM's CPU build"
        if in_ci():
            pytest.fail(f"CI must run the real-vLLM tests: {reason}", pytrace=False)
        pytest.skip(reason)
    return str(VLLM_PYTHON)
