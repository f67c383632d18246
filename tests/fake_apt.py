"""A PATH for the install recipes' tests (`make system-redis`, `make system-podman`): the real
shell tools, `id -u` printing a chosen uid and, where asked, an `apt-get` that logs its calls
and, when it works, puts the installed programs on the PATH. The recipe runs for real under
make and bash; nothing is installed, and the test can be root or not as it pleases."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOLS = ("bash", "sh", "make", "cat", "echo", "chmod")


def fake_bin(tmp: Path, uid: int, apt: str | None, programs: Sequence[str]) -> Path:
    """The PATH folder; ``apt``: "works" (an install puts ``programs`` on the PATH), "fails"
    (it exits 100) or None (no apt-get)."""
    folder = tmp / "bin"
    folder.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (folder / tool).symlink_to(found)
    _script(folder / "id", f"echo {uid}")
    if apt is not None:
        install = "; ".join(f'printf "#!/bin/sh\\n" > "{folder}/{p}"; chmod +x "{folder}/{p}"'
                            for p in programs) if apt == "works" else "exit 100"
        _script(folder / "apt-get", f'echo "$*" >> "{tmp}/apt.log"\n'
                                    f'case "$*" in *install*) {install};; esac')
    return folder


def run_target(target: str, path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-s", target], cwd=REPO, capture_output=True, text=True,
                          timeout=60,
                          env={"PATH": str(path), "HOME": os.environ.get("HOME", "/"), **env})


def apt_calls(tmp: Path) -> list[str]:
    log = tmp / "apt.log"
    return log.read_text().splitlines() if log.exists() else []


def _script(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
