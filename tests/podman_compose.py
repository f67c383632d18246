"""compose.yaml run with Podman and podman-compose, as deploy/podman/ and docs/DEPLOY.md set
them up: the tool the tests drive, and why it cannot run on a host.

`make podman` installs podman, runc and mmdebstrap with apt-get (root on Debian) and the pinned
podman-compose into .venv-compose. A host without them skips the container tests with the
reason; in CI (CI=true) that is a failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from sglang_fixture import in_ci

REPO = Path(__file__).resolve().parent.parent
PODMAN_DIR = REPO / "deploy" / "podman"
CONTAINERS_CONF = PODMAN_DIR / "containers.conf"
BASE_IMAGES = PODMAN_DIR / "base-images.sh"
COMPOSE_TOOL = REPO / ".venv-compose" / "bin" / "podman-compose"
SIM_FILES = ("compose.yaml", "compose.sim.yaml")


def tool_missing() -> str | None:
    """Why podman-compose cannot even read the files here; None when it can."""
    if shutil.which("podman") is None:
        return "no podman on the PATH (make podman: apt-get, as root on Debian)"
    if not COMPOSE_TOOL.exists():
        return f"no {COMPOSE_TOOL.relative_to(REPO)} (make podman)"
    return None


def containers_unavailable() -> str | None:
    """Why containers cannot run here; None when they can."""
    if missing := tool_missing():
        return missing
    if os.geteuid() != 0:
        return "not root: mmdebstrap builds the base images' root file system as root"
    for tool in ("runc", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"no {tool} on the PATH (make podman: apt-get, as root on Debian)"
    return None


def skip_or_fail(reason: str) -> None:
    """A host that cannot run containers skips with one line; in CI that is a failure."""
    if in_ci():
        pytest.fail(f"CI must run the compose tests: {reason}", pytrace=False)
    pytest.skip(f"containers unavailable: {reason}")


def base_env(**extra: str) -> dict[str, str]:
    """Only what podman needs from this process's environment: a variable compose.yaml reads
    (DATA_DIR, REDIS_URL, ...) set where the tests run must not change the deployment."""
    keep = {k: os.environ[k] for k in ("PATH", "HOME", "TMPDIR", "LANG") if k in os.environ}
    return {**keep, "CONTAINERS_CONF": str(CONTAINERS_CONF), **extra}


@dataclass
class Compose:
    """podman-compose on compose.yaml and compose.sim.yaml as project ``project``."""

    project: str
    env: dict[str, str]
    files: tuple[str, ...] = SIM_FILES

    def argv(self, *args: str) -> list[str]:
        flags = [a for f in self.files for a in ("-f", f)]
        return [str(COMPOSE_TOOL), "-p", self.project, *flags, *args]

    def run(self, *args: str, timeout_s: float = 300,
            check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(self.argv(*args), cwd=REPO, env=self.env, capture_output=True,
                              text=True, timeout=timeout_s)
        if check and done.returncode != 0:
            raise AssertionError(f"podman-compose {' '.join(args)} exited {done.returncode}:\n"
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        return done

    def container(self, service: str, index: int = 1) -> str:
        return f"{self.project}_{service}_{index}"

    def volume(self, name: str) -> str:
        return f"{self.project}_{name}"


def podman(*args: str, env: dict[str, str], timeout_s: float = 120,
           check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["podman", *args], env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} exited {done.returncode}: "
                             f"{done.stderr[-2000:]}")
    return done


def healthy(env: dict[str, str], container: str) -> bool:
    """Runs the container's healthcheck once. Podman 4.3 runs healthchecks from systemd
    timers only, and podman-compose waits for `service_healthy` only from Podman 4.6: without
    systemd nothing else runs them, so whoever waits on health runs the check."""
    return podman("healthcheck", "run", container, env=env, check=False).returncode == 0
