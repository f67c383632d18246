"""`make demo`: the whole pipeline on the bundled partition, on this machine.

Starts a throwaway Redis, the SGLang simulator, a short and a long worker (the
same `datagen worker` commands an operator runs), produces, follows progress,
prints the per-dataset summary and merges. Then the extraction phase: a tiny
random Llama stands in for the target model, `prepare` writes the training set,
one `gpu` worker (on the CPU here) extracts the hidden states through the queue,
and one file is checked against SpecForge's contract. Everything is shut down at
the end.

``--server sglang`` (``make demo SERVER=sglang``) runs generation against a real SGLang
0.5.23 on the CPU instead of the simulator (``cli/sglang.py``; ``make sglang-env`` installs
it): the demo's tiny Llama is built first, with the demo's tokenizer, so the server decodes
the partition's own prompt ids, and the same model is then the target of extraction. A
real CPU server decodes a few hundred tokens/s, so its settings
(``config/demo-sglang.toml``) have caps of 32 tokens and budgets of ~1,500 tokens.

``--extract vllm`` (``make demo EXTRACT=vllm``) extracts on a real vLLM (the CPU build in
.venv-vllm, ``make vllm-env``) through the `vllm` backend instead of transformers: the gpu
worker starts the engine (about a minute and a half here) and the engine writes the files. vLLM's
CPU attention needs a head size of 32 or more, so the tiny Llama then has 128 hidden and 2 heads.

``--server vllm`` (``make demo SERVER=vllm``) generates on a real vLLM (the same CPU build,
``cli/vllm.py``) launched with the capture connector: the server writes each sample's hidden
states while it generates (``capture_states``), the workers check them before they commit, and
the training folder is built from those files by the `captured` backend, with no extraction
forward pass (``config/demo-vllm.toml``: the caps and budgets of ``--server sglang``). The
demo ends with the time of each phase, saying which backend built the folder.

``--stream`` (``make demo STREAM=1``) writes no state files: the states go straight into
SpecForge's stock consumer through its Mooncake data plane, two epochs, the second recomputed
by prefill (``cli/demo_stream.py``).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from cli import sglang, vllm
from cli.demo_stream import EPOCHS, run_stream, stream_env
from cli.extraction import EXIT_INCOMPLETE, cmd_extract, committed_maps, decoder
from cli.output import merge_all, print_summary, render_produce
from cli.stack import REPO, Process, child_env, start_simulator, start_worker, wait_for_workers
from config.settings import load_settings
from datagen.celery_app import make_app
from datagen.generation.follower import follow
from datagen.generation.ledger import Ledger
from datagen.redis_server import RedisServer
from datagen.tokenization.chat import ChatEncoder
from datagen.tokenization.tokenizer import build_tiny_tokenizer
from datagen.training import handoff
from datagen.training.training_set import extraction_dir, prepare, render

DEMO_CONFIG = REPO / "config" / "demo.toml"
SGLANG_CONFIG = REPO / "config" / "demo-sglang.toml"
VLLM_CONFIG = REPO / "config" / "demo-vllm.toml"
CONFIGS = {"simulator": DEMO_CONFIG, "sglang": SGLANG_CONFIG, "vllm": VLLM_CONFIG}
# The real server's context, as the simulator's: no prompt of the partition comes near it.
SGLANG_CONTEXT = 8192
# vLLM's states in float32, as its CPU build runs the tiny Llama; `captured` casts them to
# extract_dtype when it writes SpecForge's files
CAPTURE_DTYPE = "float32"
# Small shards so the progress shows; the tiny model keeps the CPU forward to a few seconds.
EXTRACT_ENV = {"DATAGEN_SHARD_SAMPLES": "64", "DATAGEN_EXTRACT_BATCH_TOKENS": "2048",
               "DATAGEN_EXTRACT_WRITER_THREADS": "2"}
# `--extract vllm`: the engine's Python, its KV cache (GiB) and eager mode (no compile: it
# would add a minute to the start for a few hundred samples)
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
VLLM_ENV = {"DATAGEN_EXTRACT_BACKEND": "vllm", "DATAGEN_VLLM_PYTHON": str(VLLM_PYTHON),
            "DATAGEN_VLLM_ARGS": "--enforce-eager", "VLLM_CPU_KVCACHE_SPACE": "1"}
SIMULATOR_ARGS = ["--max-running-requests", "48", "--mean-output-tokens", "300",
                  "--sigma", "0.8", "--decode-step-s", "0.004", "--prefill-tokens-per-s",
                  "200000", "--context-length", "8192", "--seed", "7"]


def run_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    # SIGTERM (a timeout, `kill`) unwinds like Ctrl-C, so the finally below stops the
    # server and workers: each runs in a session of its own and would outlive the demo.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    server = getattr(args, "server", "simulator")
    if refused := _refusal(server, getattr(args, "extract", "hf"),
                           getattr(args, "stream", False)):
        print(refused)
        return 2
    config = CONFIGS[server]
    workdir = Path(args.workdir).resolve()
    with demo_lock(workdir) as held_by:
        if held_by is not None:
            print(f"demo: another demo (pid {held_by}) is running in {workdir}; wait for it "
                  "to end, or pass --workdir for a second one", file=sys.stderr)
            return 2
        return _run(args, server, config, workdir, started)


def _refusal(server: str, extract: str, stream: bool = False) -> str | None:
    """One line when this machine cannot run the asked demo, else None."""
    if stream and (server == "vllm" or extract == "vllm"):
        return ("demo --stream extracts with transformers (`hf`) into the stream, two "
                "epochs: it runs with --server simulator or sglang and --extract hf")
    if server == "sglang" and sglang.unavailable_reason():
        return f"demo --server sglang: {sglang.unavailable_reason()}"
    if server == "vllm" and vllm.unavailable_reason():
        return f"demo --server vllm: {vllm.unavailable_reason()}"
    if server == "vllm" and extract == "vllm":
        return ("demo --server vllm captures the states while it generates, so no extraction "
                "pass runs: --extract vllm does not apply")
    if extract == "vllm" and not VLLM_PYTHON.is_file():
        return (f"demo --extract vllm: no {VLLM_PYTHON}; `make vllm-env` installs vLLM's CPU "
                "build there (~3.0 GB)")
    return None


@contextmanager
def demo_lock(workdir: Path) -> Iterator[int | None]:
    """An exclusive lock on ``<workdir>.lock`` (outside the folder, which the demo empties):
    yields None when taken, else the pid of the demo holding it. Released on any exit."""
    workdir.parent.mkdir(parents=True, exist_ok=True)
    with open(workdir.with_name(workdir.name + ".lock"), "a+", encoding="utf-8") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            yield int(fh.read().strip() or 0)
            return
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        yield None


def _run(args: argparse.Namespace, server_name: str, config: Path, workdir: Path,
         started: float) -> int:
    shutil.rmtree(workdir, ignore_errors=True)
    logs = workdir / "logs"
    logs.mkdir(parents=True)
    print(f"demo: working in {workdir} (logs in {logs})", flush=True)
    tokenizer = build_tiny_tokenizer(workdir / "tokenizer")
    encoder = ChatEncoder(tokenizer)
    procs: list[Process] = []
    with RedisServer(workdir=workdir / "redis") as redis_server:
        env = {"DATAGEN_CONFIG": str(config), "DATAGEN_REDIS_URL": redis_server.url,
               "DATAGEN_OUTPUT_DIR": str(workdir / "output"),
               "DATAGEN_TOKENIZER_PATH": str(tokenizer)}
        try:
            real = server_name != "simulator"
            vllm_extract = getattr(args, "extract", "hf") == "vllm"
            server, url = _start_server(server_name, workdir, tokenizer, encoder, vllm_extract)
            procs.append(server)
            env["DATAGEN_SERVER_URL"] = url
            os.environ.update(env)
            print(f"demo: redis {redis_server.url}, {server.name} {url}", flush=True)
            workers = [start_worker(q, child_env(env), logs) for q in ("short", "long")]
            procs += workers
            wait_for_workers(redis_server.url, 2, procs=workers)
            print("demo: short and long workers are up", flush=True)
            died = _produce_and_follow(started, config, timeout_s=900 if real else 240)
            generated = time.monotonic()
            for proc in (*workers, server):  # generation is over: the CPU goes to extraction
                proc.stop()
            env.update(EXTRACT_ENV, DATAGEN_MODEL_PATH=str(workdir / "model"))
            if vllm_extract:
                env.update(VLLM_ENV)
            os.environ.update(env)
            if not real:  # the real server served it already
                _build_model(workdir, tokenizer, encoder.vocab_size, vllm_extract)  # checked
            if getattr(args, "stream", False):
                code = run_stream(config, env, logs, procs, timeout_s=1800)
                env.update(stream_env(env["DATAGEN_OUTPUT_DIR"], EPOCHS))  # saved below
                print(f"phases: generation {generated - started:.0f}s (the server's start "
                      f"included); the stream's {EPOCHS} epochs "
                      f"{time.monotonic() - generated:.0f}s, no state files")
            else:
                print(_extraction_banner(server_name, vllm_extract), flush=True)
                procs.append(start_worker("gpu", child_env(env), logs))
                code = _extract(started, config, timeout_s=900 if vllm_extract else 240)
                print(_phases(started, generated, extraction_dir(load_settings(config))))
            if died:
                print(f"demo: {died} samples were dead-lettered in generation (reasons above; "
                      "`datagen dead` lists them): the demo did not succeed")
            return code or (EXIT_INCOMPLETE if died else 0)
        finally:
            for proc in reversed(procs):
                proc.stop()
            _save_ledger(redis_server, workdir, config, env)


def _start_server(name: str, workdir: Path, tokenizer: Path, encoder: ChatEncoder,
                  vllm_extract: bool) -> tuple[Process, str]:
    if name == "vllm":
        return _start_vllm(workdir, tokenizer, encoder.vocab_size)
    if name == "sglang":
        return _start_sglang(workdir, tokenizer, encoder.vocab_size, vllm_extract)
    return _start_simulator(workdir, encoder)


def _start_simulator(workdir: Path, encoder: ChatEncoder) -> tuple[Process, str]:
    return start_simulator(workdir / "logs", SIMULATOR_ARGS + [
        "--vocab-size", str(encoder.vocab_size), "--eos-token-id",
        str(encoder.eos_token_id), "--request-log", str(workdir / "requests.jsonl")])


def _start_sglang(workdir: Path, tokenizer: Path, vocab_size: int,
                  vllm: bool) -> tuple[Process, str]:
    """The demo's model, built now, served by a real SGLang (1-3 minutes to load)."""
    _build_model(workdir, tokenizer, vocab_size, vllm)
    requests_dir = workdir / "sglang-requests"
    requests_dir.mkdir()
    proc, url = sglang.start_sglang(workdir / "model", workdir / "logs", "sglang",
                                    SGLANG_CONTEXT, requests_dir)
    print(f"demo: starting a real SGLang {sglang.SGLANG_VERSION} on the CPU ({url}; "
          f"log {proc.log_path}); it takes 1-3 minutes to load", flush=True)
    waited = sglang.wait_healthy(url, proc.alive, proc.log_path)
    print(f"demo: SGLang healthy after {waited:.0f}s", flush=True)
    return proc, url


def _start_vllm(workdir: Path, tokenizer: Path, vocab_size: int) -> tuple[Process, str]:
    """The demo's model (vLLM's CPU shape), built now, served by a real vLLM that captures
    every sample's states under the run's output folder (1-2 minutes to start)."""
    _build_model(workdir, tokenizer, vocab_size, vllm=True)
    proc, url = vllm.start_vllm(workdir / "model", workdir / "logs", SGLANG_CONTEXT,
                                workdir / "output", CAPTURE_DTYPE)
    print(f"demo: starting a real vLLM {vllm.VLLM_VERSION} (CPU build) on the CPU with the "
          f"capture connector ({url}; log {proc.log_path}); it takes 1-2 minutes to start",
          flush=True)
    waited = sglang.wait_healthy(url, proc.alive, proc.log_path, name="vLLM")
    print(f"demo: vLLM healthy after {waited:.0f}s; it writes each sample's hidden states "
          f"under {workdir / 'output' / 'states'}", flush=True)
    return proc, url


def _extraction_banner(server_name: str, vllm_extract: bool) -> str:
    if server_name == "vllm":
        return ("\ntraining folder: one gpu worker builds it from the states vLLM captured "
                "while generating (backend `captured`, no forward pass)")
    return "\nextraction: one gpu worker on the CPU" + (
        ", through a real vLLM engine (about a minute and a half to start)" if vllm_extract
        else "")


def _phases(started: float, generated: float, folder: Path) -> str:
    """The time of each phase, and whether the training folder took a forward pass."""
    meta = folder / "extraction.json"
    backend = json.loads(meta.read_text(encoding="utf-8"))["backend"] if meta.is_file() else None
    now = time.monotonic()
    if backend is None:
        second = f"extraction {now - generated:.0f}s, not finished"
    elif backend == "captured":
        second = (f"training folder {now - generated:.0f}s, built by the `captured` backend "
                  f"from the states captured while generating: no extraction forward pass ran")
    else:
        second = f"extraction {now - generated:.0f}s, a forward pass (backend `{backend}`)"
    return (f"phases: generation {generated - started:.0f}s (the server's start included); "
            f"{second}")


def _produce_and_follow(started: float, config: Path, timeout_s: float) -> int:
    from producers.producer import Producer  # noqa: PLC0415

    settings = load_settings(config)
    app = make_app(settings)
    ledger = Ledger.from_settings(settings)
    reports = Producer(settings, app, ledger).run()
    print(render_produce(reports), flush=True)
    if bad := sum(r.bad_count for r in reports):
        print(f"demo: the {bad} skipped lines are deliberate: the bundled partition carries bad "
              f"lines to show how bad input is reported (file, line, reason) while the rest "
              f"runs; see {settings.output_dir}/reports/", flush=True)
    table = follow(ledger, 1.0, app=app, timeout_s=timeout_s)
    print("\nsummary")
    print_summary(ledger, table)
    merge_all(settings, ledger)
    closed = [r.dataset for r in table if r.state.startswith("closed")]
    print(f"\ngeneration finished in {time.monotonic() - started:.0f}s; closed by budget: "
          f"{', '.join(closed) or 'none'}; records under {settings.output_dir}", flush=True)
    if closed:
        print(f"demo: a close lands past its budget by what the requests already in flight "
              f"still generate (up to {settings.short_concurrency} of them here), a larger "
              f"share of a demo's small budget than of a production one "
              f"(docs/BENCHMARKS.md, budget precision)", flush=True)
    return sum(len(ledger.dead(r.dataset)) for r in table)


# What a demo sets through the environment that its saved datagen.toml keeps. Of the stream's,
# the bound only (`datagen status` reads each epoch's counts from the ledger and shows them
# against it): with `states_to = "stream"` a later `datagen extract --config` of it would
# publish into a plane that stopped with the demo, instead of building files.
SAVED_SETTINGS = ("output_dir", "tokenizer_path", "model_path", "stream_resident_bytes")
SAVED_INTS = ("stream_resident_bytes",)


def _save_ledger(redis_server: RedisServer, workdir: Path, config: Path,
                 env: dict[str, str]) -> None:
    """Leave the run inspectable once its Redis is gone: the ledger saved to
    ``<workdir>/redis/dump.rdb`` and ``<workdir>/datagen.toml`` naming it (``saved_ledger``)
    with the run's folders, so `datagen status|dead|plot|estimate --config` answer from it."""
    try:
        redis.Redis.from_url(redis_server.url).save()
    except redis.RedisError as exc:
        print(f"demo: could not save the ledger ({exc}); `datagen status` will not see this run")
        return
    keys: dict[str, str | None] = {k: env.get(f"DATAGEN_{k.upper()}") for k in SAVED_SETTINGS}
    keys["saved_ledger"] = str(redis_server.workdir / "dump.rdb")
    head = "".join(f"{k} = {json.dumps(int(v) if k in SAVED_INTS else v)}\n"
                   for k, v in keys.items() if v)
    settings_file = workdir / "datagen.toml"
    settings_file.write_text(f"# Written by `datagen demo`: this run's settings, its ledger saved "
                             f"at the end.\n{head}\n{config.read_text(encoding='utf-8')}",
                             encoding="utf-8")
    shown = os.path.relpath(settings_file)
    shown = settings_file if shown.startswith("..") else shown
    print(f"demo: look at this run later (its Redis is stopped, the ledger saved): "
          f".venv/bin/datagen status --config {shown}  (also dead, plot, "
          f"estimate --preset kimi-k2.5 --tokens-per-s N)", flush=True)


DEMO_LAYERS = 8


def _build_model(workdir: Path, tokenizer: Path, vocab_size: int, vllm: bool = False) -> None:
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    from datagen.builders.tiny_model import build_tiny_llama  # noqa: PLC0415 (torch)

    print("\ndemo: a tiny random Llama (8 layers) as the target model", flush=True)
    hf_logging.disable_progress_bar()
    # 8 layers, so SpecForge's default aux layers [1, N//2-1, N-4] are three different ones
    # ([1, 3, 4]), as on every real target; 6 would train the drafter on [1, 2, 2].
    shape = {"hidden_size": 128, "heads": 2} if vllm else {}  # vLLM's CPU attention: head 64
    build_tiny_llama(workdir / "model", vocab_size, num_layers=DEMO_LAYERS,
                     tokenizer_dir=tokenizer, **shape)


def _extract(started: float, config: Path, timeout_s: float) -> int:
    settings = load_settings(config)
    tset = prepare(settings, committed_maps(settings), decoder(settings))
    print(render(tset), flush=True)
    code = cmd_extract(settings, argparse.Namespace(force=False, no_wait=False, interval=1.0,
                                                    timeout_s=timeout_s, hidden_size=None))
    out = extraction_dir(settings)
    print(_check_one_file(out, tset.shards[0]["path"], settings.output_dir))
    print(f"\ndemo finished in {time.monotonic() - started:.0f}s\n"
          f"  training set (shards, manifest):    {tset.directory}\n"
          f"  pre-tokenized rows (online, exact): {tset.online_rows}\n"
          f"  conversations (online, text):       {tset.conversations}\n"
          f"  SpecForge handoff (offline):        {out}  (data_<idx>.ckpt under rows_*/, "
          f"{handoff.RUN_CONFIG_NAME})")
    return code


def _check_one_file(out: Path, shard: str, output_dir: str) -> str:
    """Load the first sample's file and compare it with its record, as SpecForge reads it."""
    import torch  # noqa: PLC0415

    with open(Path(output_dir) / shard, encoding="utf-8") as fh:
        recs = [json.loads(line) for line in fh]
    # the first sample with a file: the train_max_length rule may have left some out
    rec, path = next((r, p) for r in recs for p in out.rglob(f"data_{r['idx']}.ckpt"))
    data = torch.load(path, weights_only=True)
    ids = rec["prompt_ids"] + rec["output_ids"]
    assert data["input_ids"].tolist() == ids[:len(data["input_ids"])], "input_ids differ"
    assert int(data["loss_mask"].sum()) == len(data["input_ids"]) - len(rec["prompt_ids"])
    shapes = ", ".join(f"{k} {tuple(v.shape)} {str(v.dtype).replace('torch.', '')}"
                       for k, v in data.items())
    return f"checked {path.relative_to(out)}: {shapes}"
