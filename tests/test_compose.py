"""compose.yaml and compose.sim.yaml: a real deployment, kept in step with the CLI and settings.

`docker compose config` validates both files where the Compose plugin exists, and
podman-compose (`make podman`) must read them as Docker Compose does; everywhere the files are
read with PyYAML and checked against what the code expects. test_compose_run.py runs them.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from podman_compose import SIM_FILES, Compose, base_env, skip_or_fail, tool_missing

from cli.main import _parser
from config.settings import load_settings
from simulator.__main__ import build_parser as simulator_parser

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "compose.yaml"
SIM = REPO / "compose.sim.yaml"
# The variables compose.yaml refuses to start without.
REQUIRED = {"REDIS_PASSWORD": "0123abcd", "FLOWER_BASIC_AUTH": "admin:secret"}
PROJECT_SERVICES = ("worker-short", "worker-long", "worker-gpu", "flower", "metrics",
                    "producer")


class Tagged:
    """A value under Compose's !reset or !override tag."""

    def __init__(self, tag: str, value: Any):
        self.tag, self.value = tag, value


class ComposeLoader(yaml.SafeLoader):
    pass


def _tagged(loader: ComposeLoader, node: yaml.Node) -> Tagged:
    if isinstance(node, yaml.MappingNode):
        return Tagged(node.tag, loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Tagged(node.tag, loader.construct_sequence(node, deep=True))
    return Tagged(node.tag, loader.construct_scalar(node))


for _tag in ("!reset", "!override"):
    ComposeLoader.add_constructor(_tag, _tagged)


def load(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(encoding="utf-8"), Loader=ComposeLoader)  # noqa: S506


@pytest.fixture(scope="module")
def base() -> dict[str, Any]:
    return load(COMPOSE)["services"]


@pytest.fixture(scope="module")
def sim() -> dict[str, Any]:
    return load(SIM)["services"]


class Unset(Exception):
    """A ${VAR:?message} whose variable is not set."""


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable syntax: $$, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err},
    ${VAR?err}, nested in defaults."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            end = _closing_brace(text, i + 2)
            out.append(_substitute(text[i + 2:end], env))
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _closing_brace(text: str, start: int) -> int:
    depth = 1
    for j in range(start, len(text)):
        if text.startswith("${", j):
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    raise ValueError(f"unclosed ${{ in {text!r}")


def _substitute(expr: str, env: dict[str, str]) -> str:
    name = re.match(r"[A-Za-z_][A-Za-z0-9_]*", expr)
    assert name, f"bad variable in ${{{expr}}}"
    var, op = name.group(), expr[name.end():]
    value = env.get(var)
    for sep, empty_counts in ((":-", True), ("-", False), (":?", True), ("?", False)):
        if op.startswith(sep):
            missing = value is None or (empty_counts and value == "")
            arg = interpolate(op[len(sep):], env)
            if not missing:
                return value or ""
            if "?" in sep:
                raise Unset(f"{var}: {arg}")
            return arg
    assert op == "", f"unsupported ${{{expr}}}"
    return value or ""


def command_argv(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return shlex.split(command) if isinstance(command, str) else list(command)


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    return env.value if isinstance(env, Tagged) else env


def mounts(service: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
    """target -> source of the service's volumes, variables resolved."""
    volumes = service.get("volumes", [])
    volumes = volumes.value if isinstance(volumes, Tagged) else volumes
    pairs = [interpolate(v, env).split(":")[:2] for v in volumes]
    return {target: source for source, target in pairs}


def published(service: dict[str, Any], env: dict[str, str]) -> list[str]:
    return [interpolate(port, env) for port in service.get("ports", [])]


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    deploy = service.get("deploy")
    if not isinstance(deploy, dict):
        return []
    devices = deploy.get("resources", {}).get("reservations", {}).get("devices", [])
    return [d for d in devices if "gpu" in d.get("capabilities", [])]


# -- docker compose itself, where it exists --------------------------------------------


def _compose_available() -> bool:
    if shutil.which("docker") is None:
        return False
    done = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    return done.returncode == 0


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, SIM]], ids=["real", "sim"])
def test_docker_compose_accepts_the_files(files: list[Path]) -> None:
    if not _compose_available():
        pytest.skip("no `docker compose` plugin on this machine")
    argv = ["docker", "compose"] + [a for f in files for a in ("-f", str(f))]
    argv += ["--profile", "tools", "--profile", "extract", "config", "--quiet"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **REQUIRED})
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def podman_config() -> dict[str, dict[str, Any]]:
    """What podman-compose makes of the real files and of the simulator setup."""
    if reason := tool_missing():
        skip_or_fail(reason)
    out = {}
    for name, files in (("real", ("compose.yaml",)), ("sim", SIM_FILES)):
        compose = Compose("datagen", base_env(**REQUIRED), files)
        done = compose.run("--profile", "tools", "--profile", "extract", "config", timeout_s=60)
        out[name] = yaml.safe_load(done.stdout)["services"]
    return out


def test_podman_compose_reads_the_files_as_docker_compose_does(
        podman_config: dict[str, dict[str, Any]], sim: dict[str, Any]) -> None:
    real, merged = podman_config["real"], podman_config["sim"]
    assert set(real) == set(merged) == set(load(COMPOSE)["services"])
    # The GPU services, which only run on a GPU machine, are read whole
    assert real["sglang"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == "all"
    assert real["worker-gpu"]["build"]["args"] in ({"EXTRAS": "extract"}, ["EXTRAS=extract"])
    # !reset drops, !override replaces, volumes merge by target
    sglang = merged["sglang"]
    assert not {"deploy", "volumes", "ulimits"} & set(sglang)
    assert sglang["healthcheck"]["test"] == sim["sglang"]["healthcheck"]["test"].value
    assert "deploy" not in merged["worker-gpu"]
    for name in ("producer", "worker-gpu"):
        targets = [v.split(":")[1] for v in merged[name]["volumes"]]
        assert len(targets) == len(set(targets)), merged[name]["volumes"]
        assert "no-model:/model:ro" in merged[name]["volumes"], name
    assert merged["producer"]["environment"]["DATAGEN_TOKENIZER_PATH"] == \
        "/opt/datagen/tiny-tokenizer"


# -- the real deployment ------------------------------------------------------------------


def test_services_run_the_official_images_and_the_project_image(base: dict[str, Any]) -> None:
    assert base["redis"]["image"] == "redis:7"
    assert base["sglang"]["image"] == "lmsys/sglang:latest"
    assert (REPO / "Dockerfile").is_file()
    for name in PROJECT_SERVICES:
        assert "build" in base[name], name
        assert interpolate(base[name]["image"], {}).startswith("datagen"), name


def test_redis_needs_a_password_and_keeps_an_append_only_file(base: dict[str, Any]) -> None:
    argv = base["redis"]["command"]
    assert argv[argv.index("--appendonly") + 1] == "yes"
    password = argv[argv.index("--requirepass") + 1]
    assert interpolate(password, REQUIRED) == REQUIRED["REDIS_PASSWORD"]
    with pytest.raises(Unset):
        interpolate(password, {})
    assert base["redis"]["volumes"] and base["redis"]["healthcheck"]["test"]


def test_flower_requires_a_login_from_a_required_variable(base: dict[str, Any]) -> None:
    auth = environment(base["flower"])["DATAGEN_FLOWER_BASIC_AUTH"]
    assert interpolate(auth, REQUIRED) == REQUIRED["FLOWER_BASIC_AUTH"]
    with pytest.raises(Unset):
        interpolate(auth, {"REDIS_PASSWORD": "x"})


def test_published_ports_bind_loopback_unless_asked(base: dict[str, Any]) -> None:
    assert published(base["flower"], {}) == ["127.0.0.1:5555:5555"]
    assert published(base["flower"], {"FLOWER_BIND": "0.0.0.0"}) == ["0.0.0.0:5555:5555"]
    for name, service in base.items():
        for port in published(service, {}):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port}"


def test_every_datagen_command_is_a_cli_command(base: dict[str, Any],
                                                sim: dict[str, Any]) -> None:
    parser = _parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    used = [command_argv(s) for s in [*base.values(), *sim.values()]]
    used = [argv for argv in used if argv and argv[0] == "datagen"]
    assert len(used) >= 6
    for argv in used:
        assert argv[1] in subcommands, f"`{' '.join(argv)}`: no such datagen command"
        parser.parse_args(argv[1:])  # exits on an unknown flag


def test_workers_take_concurrency_from_the_settings_only(base: dict[str, Any]) -> None:
    for queue in ("short", "long", "gpu"):
        service = base[f"worker-{queue}"]
        argv = command_argv(service)
        assert argv == ["datagen", "worker", queue]
        assert not {"-c", "--concurrency", "--autoscale"} & set(argv)
        assert not any(a.startswith("--concurrency=") for a in argv)
        config = environment(service)["DATAGEN_CONFIG"]
        assert config in mounts(service, {}), f"worker-{queue}: {config} is not mounted"


def test_every_process_shares_redis_server_output_and_settings(base: dict[str, Any]) -> None:
    sources: dict[str, set[str]] = {}
    for name in PROJECT_SERVICES:
        env = {k: interpolate(str(v), REQUIRED) for k, v in environment(base[name]).items()}
        assert env["DATAGEN_REDIS_URL"] == "redis://:0123abcd@redis:6379/0", name
        assert env["DATAGEN_SERVER_URL"] == "http://sglang:30000", name
        assert env["DATAGEN_OUTPUT_DIR"] == "/data/output", name
        for target, source in mounts(base[name], {}).items():
            sources.setdefault(target, set()).add(source)
    # One output volume and one settings file for all: a differing setting (visibility
    # timeout) in one process makes another's tasks run twice.
    assert sources["/data/output"] == {"output"}
    assert sources["/etc/datagen/settings.toml"] == {"./config/default.toml"}
    # A REDIS_URL (rediss://, another machine's Redis) replaces the default whole.
    url = environment(base["worker-short"])["DATAGEN_REDIS_URL"]
    assert interpolate(url, {**REQUIRED, "REDIS_URL": "rediss://h:6380/1"}) == "rediss://h:6380/1"


def test_sglang_serves_the_model_on_all_gpus(base: dict[str, Any]) -> None:
    sglang = base["sglang"]
    argv = shlex.split(interpolate(sglang["command"], {"MODEL_PATH": "/model"}))
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--model-path"] == "/model" and flags["--tp"] == "8"
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == "30000"
    assert "--enable-hierarchical-cache" in argv
    extra = interpolate(sglang["command"], {"SGLANG_EXTRA_ARGS": "--mem-fraction-static 0.8"})
    assert extra.endswith("--mem-fraction-static 0.8")
    assert gpu_devices(sglang) and sglang["shm_size"]
    assert "/health" in " ".join(sglang["healthcheck"]["test"])


# Time a stopping worker needs after shutdown_grace_s: abort its requests and re-enqueue
# their samples. 150 in flight took 0.5 s on loopback (SIGTERM to exit, minus the grace);
# the margin covers network round trips and a router's fan-out of each abort.
HAND_BACK_MARGIN_S = 15.0


def duration_s(text: str) -> float:
    """A Compose duration: "60s", "1m30s", "1h", "500ms"."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"bad duration {text!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


def test_generation_workers_get_longer_to_stop_than_their_shutdown_grace(
        base: dict[str, Any]) -> None:
    # The settings the services mount by default, and the built-in default.
    graces = {load_settings(REPO / "config" / "default.toml", env={}).shutdown_grace_s,
              load_settings(None, env={}).shutdown_grace_s}
    for name in ("worker-short", "worker-long"):
        stop = duration_s(interpolate(base[name]["stop_grace_period"], {}))
        # Docker SIGKILLs a container stop_grace_period after SIGTERM: the worker must have
        # handed its requests back by then.
        assert stop >= max(graces) + HAND_BACK_MARGIN_S, (name, stop, graces)
    longer = interpolate(base["worker-short"]["stop_grace_period"], {"WORKER_STOP_GRACE": "5m"})
    assert duration_s(longer) == 300


def test_gpu_worker_reserves_one_gpu(base: dict[str, Any]) -> None:
    worker = base["worker-gpu"]
    [device] = gpu_devices(worker)
    assert [interpolate(d, {}) for d in device["device_ids"]] == ["0"]
    assert environment(worker)["CUDA_VISIBLE_DEVICES"] == "0"
    assert worker["build"]["args"]["EXTRAS"] == "extract"


def test_producer_is_a_one_shot_tool(base: dict[str, Any]) -> None:
    producer = base["producer"]
    assert command_argv(producer) == ["datagen", "run"]
    assert producer["restart"] == "no" and "tools" in producer["profiles"]


# -- the simulator override ----------------------------------------------------------------


def test_sim_override_replaces_sglang_by_the_simulator(base: dict[str, Any], sim: dict[str, Any],
                                                       encoder: Any) -> None:
    sglang = sim["sglang"]
    assert interpolate(sglang["image"], {}) == interpolate(base["worker-short"]["image"], {})
    argv = command_argv(sglang)
    assert argv[:3] == ["python", "-m", "simulator"]
    args = simulator_parser().parse_args(argv[3:])
    assert (args.host, args.port) == ("0.0.0.0", 30000)
    # The producer tokenizes with the tokenizer the image builds: the same vocabulary.
    assert (args.vocab_size, args.eos_token_id) == (encoder.vocab_size, encoder.eos_token_id)
    assert environment(sim["producer"])["DATAGEN_TOKENIZER_PATH"] in (
        REPO / "Dockerfile").read_text(encoding="utf-8")
    test = sglang["healthcheck"]["test"]
    # Replaced, not appended to compose.yaml's (podman-compose appends a list it merges)
    assert isinstance(test, Tagged) and test.tag == "!override"
    assert "/health" in " ".join(test.value)


def test_sim_override_drops_every_gpu_reservation(base: dict[str, Any],
                                                  sim: dict[str, Any]) -> None:
    for name, service in base.items():
        if not gpu_devices(service):
            continue
        override = sim.get(name, {}).get("deploy")
        assert isinstance(override, Tagged) and override.tag == "!reset", name
    for name, service in sim.items():
        assert not gpu_devices(service), name


def merged_mounts(base: dict[str, Any], over: dict[str, Any]) -> dict[str, str]:
    """target -> source after Compose's merge: by target path, or none under !reset."""
    volumes = over.get("volumes", [])
    if isinstance(volumes, Tagged) and volumes.tag == "!reset":
        return {}
    return {**mounts(base, {}), **mounts(over, {})}


def test_sim_override_needs_no_model_folder(base: dict[str, Any], sim: dict[str, Any]) -> None:
    declared = load(SIM)["volumes"]
    for name in ("sglang", "producer", "worker-gpu"):
        source = merged_mounts(base[name], sim[name]).get("/model")
        # No host folder: nothing at /model, or an empty named volume in its place
        assert source is None or source in declared, (name, source)
    # The producer still gets the partition, the output and the settings
    assert set(merged_mounts(base["producer"], sim["producer"])) == {
        "/etc/datagen/settings.toml", "/data/output", "/data/partition", "/model"}


def test_image_copies_only_what_exists_and_is_not_ignored() -> None:
    ignored = {line.strip().rstrip("/") for line in
               (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
               if line.strip() and not line.startswith("#")}
    for line in (REPO / "Dockerfile").read_text(encoding="utf-8").splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), source
                assert source.split("/")[0] not in ignored, f"{source} is in .dockerignore"
