"""The front door works as documented: make targets, CLI commands, the settings reference."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from conftest import CLI_HANG_S, wait_until
from demo_runner import demo_env, run_demo

from cli.main import _parser, settings_from
from cli.stack import REPO
from config.settings import ENV_PREFIX, Settings
from datagen.redis_server import free_port

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def make_help_targets() -> list[str]:
    out = subprocess.run(["make", "-s", "help"], cwd=REPO, capture_output=True, text=True,
                         timeout=CLI_HANG_S, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def cli_commands() -> set[str]:
    sub = next(a for a in _parser()._actions if a.dest == "command")
    return set(sub.choices)


def test_make_help_lists_every_target_with_one_line() -> None:
    targets = make_help_targets()
    expected = {"install", "demo", "test", "lint", "up", "down", "produce", "workers",
                "worker-gpu", "flower", "status", "merge", "extract", "estimate", "bench"}
    assert expected <= set(targets)
    assert len(targets) == len(set(targets))


@pytest.mark.parametrize("target", [t for t in make_help_targets() if t != "clean"])
def test_every_make_target_resolves(target: str) -> None:
    # A dry run proves the target and its recipe exist (Docker and GPU targets included).
    result = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True,
                            timeout=CLI_HANG_S)
    assert result.returncode == 0, result.stderr


def test_every_datagen_command_in_the_docs_exists() -> None:
    commands = cli_commands()
    used = set()
    for doc in DOCS:
        used |= set(re.findall(r"\bdatagen ([a-z][a-z-]+)", doc.read_text()))
    # Words after "datagen" in prose that are not commands.
    prose = {"and", "is", "the", "as", "to", "for", "with", "on", "runs", "in", "writes",
             "command", "commands", "worker", "workers", "pipeline", "ledger", "dev"}
    missing = sorted(u for u in used - prose if u not in commands)
    assert not missing, f"documented but not in the CLI: {missing}"


@pytest.mark.parametrize("command", sorted(cli_commands()))
def test_every_cli_command_answers_help(command: str) -> None:
    result = subprocess.run([sys.executable, "-m", "cli.main", command, "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=CLI_HANG_S)
    assert result.returncode == 0 and "usage" in result.stdout, result.stderr


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    return next(a for a in _parser()._actions if a.dest == "command").choices


def test_every_option_of_every_command_has_one_line_of_help() -> None:
    for name, parser in _subparsers().items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            label = "/".join(action.option_strings) or action.dest
            assert action.help and action.help.strip(), f"datagen {name} {label}: no help"
            assert "\n" not in action.help, f"datagen {name} {label}: more than one line"


def test_each_command_lists_only_the_settings_flags_it_reads(monkeypatch) -> None:
    def flags(name: str) -> set[str]:
        return {o for a in _subparsers()[name]._actions for o in a.option_strings}

    generation = {"--short-concurrency", "--long-max-tokens", "--partition", "--tokenizer"}
    for name in ("status", "dead", "budget", "flower", "metrics", "extract", "calibrate"):
        if name == "budget":  # reopening a dataset enqueues: it produces
            assert generation <= flags(name)
            continue
        assert not generation & flags(name), f"datagen {name} lists generation flags"
    assert {"--config", "--redis-url"} <= flags("status")
    assert generation <= flags("produce") and generation <= flags("worker")
    # The flags the README documents keep their names.
    assert {"--partition", "--data-dir", "--output-dir", "--server-url", "--redis-url",
            "--tokenizer", "--token-budget"} <= flags("run")
    # A settings flag still lands in the settings (and in the environment for child
    # processes: monkeypatch puts the variable back afterwards).
    monkeypatch.setenv("DATAGEN_REDIS_URL", "redis://unused:1/0")
    args = _parser().parse_args(["status", "--redis-url", "redis://h:1/0"])
    assert settings_from(args).redis_url == "redis://h:1/0"


def test_the_configuration_reference_lists_every_setting_and_is_current() -> None:
    from config.reference import render

    text = (REPO / "docs" / "CONFIGURATION.md").read_text()
    assert text == render(), "regenerate: python -m config.reference > docs/CONFIGURATION.md"
    for field in dataclasses.fields(Settings):
        assert f"`{field.name}`" in text, field.name
        assert ENV_PREFIX + field.name.upper() in text, field.name


def test_default_toml_lists_every_setting_with_its_default_and_is_current() -> None:
    from config.reference import render_toml
    from config.settings import load_settings

    path = REPO / "config" / "default.toml"
    text = path.read_text()
    assert text == render_toml(), "regenerate: python -m config.reference --toml > " \
        "config/default.toml"
    for field in dataclasses.fields(Settings):
        assert re.search(rf"^(# )?{field.name} =|^\[{field.name}\]", text, re.M), field.name
    # Loaded as it is, it gives exactly the defaults (nothing from this process's environment).
    assert load_settings(path, env={}) == Settings()


def test_the_docs_stand_on_their_own() -> None:
    for path in [*DOCS, *REPO.glob("*/*.py"), *REPO.glob("*/*/*.py")]:
        if ".venv" not in path.parts and path != Path(__file__):
            assert "REFERENCE" not in path.read_text(), f"{path} cites a file outside the repo"


def test_readme_first_screen_has_the_two_commands() -> None:
    first_screen = "\n".join(Path(REPO / "README.md").read_text().splitlines()[:30])
    assert "make demo" in first_screen and "make test" in first_screen
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in ci


def test_every_relative_link_in_the_docs_points_to_a_file() -> None:
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#:]+)\)", doc.read_text()):
            if not (doc.parent / target).exists():
                broken.append(f"{doc.name}: {target}")
    assert not broken, broken


def local_trial_block() -> str:
    text = (REPO / "docs" / "DEPLOY.md").read_text()
    block = text.split("<!-- local-trial:start -->", 1)[1].split("<!-- local-trial:end -->")[0]
    return block.strip().removeprefix("```bash").removesuffix("```")


@pytest.mark.slow
def test_the_local_trial_runs_as_written(tmp_path: Path) -> None:
    # Given: DEPLOY.md's local trial, with its ports and folder set to free ones
    ports = {name: str(free_port()) for name in ("REDIS_PORT", "SIM_PORT", "FLOWER_PORT")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")}
    env.update(ports, WORK=str(tmp_path / "trial"))
    log = tmp_path / "trial.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", local_trial_block()],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        # When: it runs to its last line
        assert proc.wait(timeout=540) == 0, log.read_text()[-3000:]
        text = log.read_text()
        # Then: the run finished with every dataset done or closed, the table was printed,
        # and Flower answers with its login only
        assert "total" in text and "closed at budget" in text, text[-3000:]
        records = list((tmp_path / "trial" / "out").rglob("raw_responses.jsonl"))
        assert records and any(p.stat().st_size for p in records)
        assert list((tmp_path / "trial" / "out" / "training" / "shards").glob("*.jsonl"))
        states = tmp_path / "trial" / "out" / "training" / "hidden_states"
        assert list(states.rglob("data_*.ckpt")) and (states / "vocab_mapping.pt").is_file()
        assert "specforge train --config" in text
        flower = f"http://127.0.0.1:{ports['FLOWER_PORT']}"
        wait_until(lambda: _status(f"{flower}/healthcheck") == 200, 120, what="Flower")
        assert _status(f"{flower}/api/workers") == 401
        assert _status(f"{flower}/api/workers", ("trial", "change-me")) == 200
    finally:
        _kill_group(proc)


def _status(url: str, auth: tuple[str, str] | None = None) -> int | None:
    try:
        return requests.get(url, auth=auth, timeout=10).status_code
    except requests.RequestException:
        return None


def _kill_group(proc: subprocess.Popen) -> None:
    """Everything the block left running shares its process group."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(2 if sig == signal.SIGTERM else 0)


@pytest.mark.slow
def test_make_demo_runs_end_to_end(tmp_path: Path) -> None:
    # The README's first command, as written (its folder moved to a temporary one)
    env = demo_env()
    work = tmp_path / "demo"
    result = run_demo(["make", "demo", f"ARGS=--workdir {work}"], timeout_s=900, env=env)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "demo finished" in result.stdout and "specforge train" in result.stdout
    extracted = list((work / "output" / "training" / "hidden_states").rglob("data_*.ckpt"))
    assert extracted, result.stdout[-2000:]
    assert (work / "output" / "training" / "hidden_states" / "vocab_mapping.pt").is_file()
    # the demo's drafter trains on three different layers, as on a real target
    aux = json.loads((work / "output" / "training" / "hidden_states" / "extraction.json")
                     .read_text())["aux_layer_ids"]
    assert len(set(aux)) == 3, aux
    # its deliberate bad lines and its close past a small budget are explained, not alarming
    assert "skipped lines are deliberate" in result.stdout
    assert "a close lands past its budget by what the requests already in flight" in result.stdout

    # Then: with the demo's Redis gone, the commands it names answer on its run
    line = next(x for x in result.stdout.splitlines() if "look at this run later" in x)
    status = line.split("saved): ", 1)[1].split("  (also")[0].split()
    assert status[:2] == [".venv/bin/datagen", "status"], line

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([status[0], *argv, *status[2:]], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)

    shown = run("status")
    assert shown.returncode == 0, shown.stderr
    assert "B1_chat     closed at budget" in shown.stdout and "A1_code     done" in shown.stdout
    dead = run("dead")
    assert dead.returncode == 0 and "B1_chat: none dead" in dead.stdout, dead.stderr
    plan = run("estimate", "--preset", "kimi-k2.5", "--tokens-per-s", "1000")
    assert plan.returncode == 0, plan.stderr
    assert "the prepared training set (after train_max_length" in plan.stdout


def test_a_second_demo_on_the_same_folder_is_refused_with_one_line(tmp_path: Path) -> None:
    from cli.demo import demo_lock

    work = tmp_path / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")}
    with demo_lock(work) as held_by:  # Given: a demo running in the folder
        assert held_by is None
        (work / "keep.txt").parent.mkdir(parents=True, exist_ok=True)
        (work / "keep.txt").write_text("the running demo's file")
        # When: a second demo starts on it
        second = subprocess.run([sys.executable, "-m", "cli.main", "demo", "--workdir",
                                 str(work)], cwd=REPO, env=env, capture_output=True,
                                text=True, timeout=300)
    # Then: refused at once, one line naming the running demo; its folder untouched
    assert second.returncode == 2
    assert second.stderr.strip() == (f"demo: another demo (pid {os.getpid()}) is running in "
                                     f"{work}; wait for it to end, or pass --workdir for a "
                                     "second one")
    assert (work / "keep.txt").read_text() == "the running demo's file"
    with demo_lock(work) as held_by:  # and the lock is free again once the first one ends
        assert held_by is None


@pytest.mark.slow
def test_a_demo_whose_samples_were_dead_lettered_does_not_report_success(
        tmp_path: Path) -> None:
    # Given: responses cut at 64 tokens, and cut responses dead-lettered
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")}
    env.update(DATAGEN_KEEP_TRUNCATED="false", DATAGEN_SHORT_MAX_TOKENS="64",
               DATAGEN_LONG_MAX_TOKENS="64")
    work = tmp_path / "demo"
    # When: the demo runs
    result = subprocess.run([sys.executable, "-m", "cli.main", "demo", "--workdir", str(work)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    # Then: it names the dead letters and exits 3, not 0
    assert result.returncode == 3, (result.stdout + result.stderr)[-4000:]
    assert "dead letters:" in result.stdout
    assert "samples were dead-lettered in generation" in result.stdout
    assert "the demo did not succeed" in result.stdout


def test_the_documented_capture_arguments_are_server_args(tmp_path: Path) -> None:
    # Given: DEPLOY.md's vLLM-with-capture block, its model a config.json of 61 layers
    from datagen.servers.capture import server_args

    text = (REPO / "docs" / "DEPLOY.md").read_text()
    block = text.split("<!-- vllm-capture:start -->", 1)[1].split("<!-- vllm-capture:end -->")[0]
    line = block[block.index("CAPTURE=$("):block.index("bfloat16)") + len("bfloat16)")]
    model = tmp_path / "Kimi-K2.5"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 61},
                                                   "vision_config": {}}))
    line = line.replace("/models/Kimi-K2.5", str(model))
    # When: its CAPTURE= line runs at the repository root, as written
    result = subprocess.run(["bash", "-euc", f'{line}\nprintf "%s" "$CAPTURE"'], cwd=REPO,
                            capture_output=True, text=True, timeout=CLI_HANG_S)
    # Then: the words it gives `vllm serve` are server_args'
    assert result.returncode == 0, result.stderr
    assert shlex.split(result.stdout) == server_args(str(model), "/mnt/shared/run1",
                                                     "bfloat16")
    assert "--limit-mm-per-prompt" in shlex.split(result.stdout)  # Kimi-K2.5: text only
    assert "--tensor-parallel-size 8" in block and "--enable-scale-out" in block
