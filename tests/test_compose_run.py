"""compose.yaml with compose.sim.yaml, run as its first lines say, in containers (Podman):
`up -d`, more short workers with `--scale`, `run --rm producer` to the end, Flower behind its
login, the metrics endpoint, `down`; then the records on the output volume counted against
the ledger. The GPU services (`sglang` itself, `worker-gpu`) are only read (test_compose.py).

The base images compose.yaml and the Dockerfile name are built here from Debian 12
(deploy/podman/base-images.sh, once per host); the project image is built from the Dockerfile
each run. Everything waits on events (health checks, Flower's worker list, the producer's
exit), never on a sleep.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from conftest import wait_until
from podman_compose import (
    BASE_IMAGES,
    REPO,
    Compose,
    base_env,
    containers_unavailable,
    healthy,
    podman,
    skip_or_fail,
)

from config.settings import load_settings
from datagen.generation.ledger import Ledger
from datagen.servers.launch import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

PARTITION = REPO / "data" / "demo" / "partition"
SHORT_WORKERS = 3
# Bounds for a step that hangs, never a measure of speed: the first build installs the
# locked requirements from PyPI.
BUILD_TIMEOUT_S = 900
STEP_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    """The stand-in base images (kept between runs) and the project image (built now);
    the environment podman runs in."""
    if reason := containers_unavailable():
        skip_or_fail(reason)
    env = base_env()
    done = subprocess.run([str(BASE_IMAGES)], env=env, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        skip_or_fail(f"{BASE_IMAGES.name} failed: {done.stderr.strip()[-1500:]}")
    probe = podman("run", "--rm", "--network", "none", "docker.io/library/redis:7", "true",
                   env=env, check=False)
    if probe.returncode != 0:
        skip_or_fail(f"a container does not start: {probe.stderr.strip()[-1500:]}")
    return env


@pytest.fixture
def project(images: dict[str, str]) -> Iterator[Compose]:
    """A compose project of its own (never an operator's `datagen`), on free loopback
    ports, removed with its volumes at the end."""
    env = {**images, "REDIS_PASSWORD": secrets.token_hex(16),
           "FLOWER_BASIC_AUTH": f"admin:{secrets.token_hex(8)}"}
    for port in ("REDIS_PORT", "SGLANG_PORT", "FLOWER_PORT", "METRICS_PORT"):
        env[port] = str(free_port())
    compose = Compose(f"datagen-test-{uuid.uuid4().hex[:8]}", env)
    try:
        yield compose
    finally:
        compose.run("down", "--remove-orphans", "--volumes", check=False)
        label = f"label=io.podman.compose.project={compose.project}"
        for kind in ("container", "volume"):
            names = podman(kind, "ls", "-q", "--filter", label, env=env, check=False).stdout
            if names.split():
                podman(kind, "rm", "-f", *names.split(), env=env, check=False)


class Flower:
    def __init__(self, port: str, auth: str):
        self.url = f"http://127.0.0.1:{port}"
        self.auth = tuple(auth.split(":", 1))

    def get(self, path: str, login: bool = True) -> requests.Response:
        return requests.get(self.url + path, auth=self.auth if login else None, timeout=30)

    def workers(self) -> list[str]:
        return sorted(self.get("/api/workers?refresh=1").json())

    def tasks(self) -> dict[str, dict[str, Any]]:
        return self.get("/api/tasks?limit=100000").json()


def fleet(flower: Flower, short: int) -> bool:
    names = flower.workers()
    return (sum(n.startswith("short@") for n in names) == short
            and sum(n.startswith("long@") for n in names) == 1)


def ledger_of(compose: Compose) -> Ledger:
    url = f"redis://:{compose.env['REDIS_PASSWORD']}@127.0.0.1:{compose.env['REDIS_PORT']}/0"
    return Ledger.from_settings(load_settings(REPO / "config" / "default.toml",
                                              env={"DATAGEN_REDIS_URL": url}))


def input_lines(dataset: str) -> int:
    return sum(1 for shard in sorted((PARTITION / dataset).glob("*.jsonl"))
               for line in shard.read_text(encoding="utf-8").splitlines() if line.strip())


def read_jsonl(*paths: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in paths for line in path.read_text().splitlines()]


def volume_path(compose: Compose, name: str) -> Path:
    done = podman("volume", "inspect", compose.volume(name), "--format", "{{.Mountpoint}}",
                  env=compose.env)
    return Path(done.stdout.strip())


# What a worker or the producer logs when a sample runs again while an earlier run of it may
# still finish (docs/RELIABILITY.md): a reaped lease, a server taken for lost, a commit whose
# lease had ended, a sweep, Redis away.
RERUN_SIGNS = ("went stale", "cannot be reached", "after its lease ended", "sweep re-enqueued",
               "Redis unreachable", "dropped", "lease ended")


def rerun_evidence(compose: Compose, producer_out: str) -> str:
    """The lines that say why a sample ran twice, read before `down` removes the
    containers: every worker's matching log lines, its restart count, the producer's."""
    names = [compose.container("worker-long")] + [compose.container("worker-short", i)
                                                  for i in range(1, SHORT_WORKERS + 1)]
    restarts = podman("inspect", "--format", "{{.Name}} restarts={{.RestartCount}}", *names,
                      env=compose.env, check=False).stdout.split("\n")
    lines = [line for line in restarts if line.strip()]
    for name in names:
        logs = podman("logs", "-t", name, env=compose.env, check=False)
        lines += [f"{name}: {line}" for line in (logs.stdout + logs.stderr).splitlines()
                  if any(sign in line for sign in RERUN_SIGNS)]
    lines += [f"producer: {line}" for line in producer_out.splitlines()
              if any(sign in line for sign in RERUN_SIGNS)]
    return "\n".join(lines[:80])


def test_scaled_deployment_stores_every_sample_once(project: Compose) -> None:
    compose, env = project, project.env
    flower = Flower(env["FLOWER_PORT"], env["FLOWER_BASIC_AUTH"])
    compose.run("build", "worker-short", timeout_s=BUILD_TIMEOUT_S)  # the project image

    # Given: the stack up, Flower first, then three short workers instead of one
    compose.run("up", "-d", timeout_s=STEP_TIMEOUT_S)
    for service in ("redis", "sglang", "flower"):
        wait_until(lambda s=service: healthy(env, compose.container(s)), STEP_TIMEOUT_S,
                   interval_s=1, what=f"{service} to be healthy")
    wait_until(lambda: fleet(flower, short=1), STEP_TIMEOUT_S, interval_s=1,
               what="a short and a long worker in Flower")
    compose.run("up", "-d", "--scale", f"worker-short={SHORT_WORKERS}", timeout_s=STEP_TIMEOUT_S)
    wait_until(lambda: fleet(flower, short=SHORT_WORKERS), STEP_TIMEOUT_S, interval_s=1,
               what=f"{SHORT_WORKERS} short workers in Flower")

    # When: the producer runs to the end
    run = compose.run("--profile", "tools", "run", "--rm", "producer", timeout_s=900)

    # Then: Flower answers behind its login and saw the tasks, run by more than one short worker
    assert flower.get("/", login=False).status_code == 401
    assert flower.get("/").status_code == 200
    tasks = flower.tasks()
    ran = {t["worker"] for t in tasks.values()}
    assert ran <= set(flower.workers()), ran
    assert sum(w.startswith("short@") for w in ran) > 1, ran
    # ... the metrics endpoint counts what the ledger counts
    metrics = requests.get(f"http://127.0.0.1:{env['METRICS_PORT']}/metrics", timeout=30)
    assert metrics.status_code == 200
    ledger = ledger_of(compose)
    datasets = sorted(p.name for p in PARTITION.iterdir() if p.is_dir())
    snapshots = {d: ledger.snapshot(d) for d in datasets}
    committed = {d: ledger.committed(d) for d in datasets}
    for d, snap in snapshots.items():
        assert f'datagen_samples{{dataset="{d}"}} {float(snap["stats"]["samples"])}' \
            in metrics.text, d
        assert snap["pending"] == snap["in_flight"] == snap["dead"] == 0, snap
    assert len(tasks) >= sum(s["stats"]["samples"] for s in snapshots.values())

    evidence = rerun_evidence(compose, run.stdout + run.stderr)

    # When: the stack goes down (the volumes stay)
    compose.run("down", "--remove-orphans", timeout_s=STEP_TIMEOUT_S)
    left = podman("ps", "-aq", "--filter", f"label=io.podman.compose.project={compose.project}",
                  env=env).stdout
    assert left.split() == []

    # Then: every input line is a record or a reported bad line; each sample stored once, and
    # counted once, with the record the ledger names
    output = volume_path(compose, "output")
    for d in datasets:
        records = read_jsonl(*sorted((output / "records" / d).glob("*.jsonl")))
        ids = [r["id"] for r in records]
        # a sample stored twice names its cause in the workers' lines (none in a clean run)
        assert len(ids) == len(set(ids)) == snapshots[d]["stats"]["samples"], \
            f"{d}: {len(ids)} records of {len(set(ids))} samples; why:\n{evidence}"
        # (budget_counts "trainable": what SpecForge trains, each record's trainable_tokens)
        assert {r["id"]: f"{r['rid']} {r['trainable_tokens']}" for r in records} == committed[d]
        assert sum(r["trainable_tokens"] for r in records) == snapshots[d]["tokens"], d
        bad = output / "reports" / f"{d}.bad.txt"
        bad_lines = len(bad.read_text().splitlines()) if bad.exists() else 0
        assert len(ids) + bad_lines == input_lines(d), (d, len(ids), bad_lines)
        merged = read_jsonl(output / d / "raw_responses.jsonl")
        assert sorted(r["id"] for r in merged) == sorted(ids), d
        assert f"{d}: {len(ids)} records" in run.stdout, run.stdout[-2000:]
