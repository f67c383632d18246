"""`make test` installs podman, runc and mmdebstrap for the compose test where it can (CI: root
on Debian), and never fails for want of them: the compose test then skips with the reason.

The recipe runs for real under make and bash; `id` and `apt-get` are stand-ins on a PATH of
their own, so the test installs nothing and can be root or not as it pleases.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOOLS = ("bash", "sh", "make", "cat", "echo", "chmod")
PROGRAMS = ("podman", "runc", "mmdebstrap", "catatonit")


def fake_bin(tmp: Path, uid: int, apt: str | None) -> Path:
    """A PATH with the real shell tools, `id -u` printing ``uid`` and, if ``apt`` is "works"
    or "fails", an apt-get that logs its calls (and on install, when it works, puts the
    programs on the PATH)."""
    folder = tmp / "bin"
    folder.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (folder / tool).symlink_to(found)
    _script(folder / "id", f"echo {uid}")
    if apt is not None:
        install = "; ".join(f'printf "#!/bin/sh\\n" > "{folder}/{p}"; chmod +x "{folder}/{p}"'
                            for p in PROGRAMS) if apt == "works" else "exit 100"
        _script(folder / "apt-get", f'echo "$*" >> "{tmp}/apt.log"\n'
                                    f'case "$*" in *install*) {install};; esac')
    return folder


def _script(path: Path, body: str) -> None:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def run_step(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-s", "system-podman"], cwd=REPO, capture_output=True,
                          text=True, timeout=60,
                          env={"PATH": str(path), "HOME": os.environ.get("HOME", "/")})


def apt_calls(tmp: Path) -> list[str]:
    log = tmp / "apt.log"
    return log.read_text().splitlines() if log.exists() else []


def test_as_root_with_apt_it_installs_podman_runc_and_mmdebstrap(tmp_path: Path) -> None:
    path = fake_bin(tmp_path, uid=0, apt="works")
    done = run_step(path)
    assert done.returncode == 0, done.stderr
    assert apt_calls(tmp_path)[0].startswith("update")
    packages = apt_calls(tmp_path)[1].split("--no-install-recommends")[1].split()
    assert {"podman", "runc", "mmdebstrap", "catatonit", "netavark", "aardvark-dns"} <= set(
        packages)
    # ... and only once: with the programs on the PATH the step does nothing
    assert run_step(path).returncode == 0 and len(apt_calls(tmp_path)) == 2


@pytest.mark.parametrize("uid, apt", [(1000, "works"), (0, None), (0, "fails")],
                         ids=["not-root", "no-apt", "apt-fails"])
def test_without_an_install_make_goes_on_and_says_why(tmp_path: Path, uid: int,
                                                      apt: str | None) -> None:
    done = run_step(fake_bin(tmp_path, uid=uid, apt=apt))
    assert done.returncode == 0, done.stderr
    assert "the compose test will skip" in done.stdout
    if apt != "fails":
        assert apt_calls(tmp_path) == []
