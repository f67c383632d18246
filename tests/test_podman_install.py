"""`make test` installs podman, runc and mmdebstrap for the compose test where it can (CI: root
on Debian), and never fails for want of them: the compose test then skips with the reason.

The recipe runs for real under make and bash; `id` and `apt-get` are stand-ins on a PATH of
their own, so the test installs nothing and can be root or not as it pleases.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import fake_apt
import pytest
from fake_apt import apt_calls, run_target

PROGRAMS = ("podman", "runc", "mmdebstrap", "catatonit")


def fake_bin(tmp: Path, uid: int, apt: str | None) -> Path:
    return fake_apt.fake_bin(tmp, uid, apt, PROGRAMS)


def run_step(path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return run_target("system-podman", path, **env)


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
