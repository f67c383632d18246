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
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from cli import sglang
from cli.extraction import cmd_extract, committed_maps, decoder
from cli.output import merge_all, print_summary, render_produce
from cli.stack import REPO, Process, child_env, start_simulator, start_worker, wait_for_workers
from config.settings import load_settings
from datagen.celery_app import make_app
from datagen.generation.follower import follow
from datagen.generation.ledger import Ledger
from datagen.redis_server import RedisServer
from datagen.tokenization.tokenizer import ChatEncoder, build_tiny_tokenizer
from datagen.training import handoff
from datagen.training.training_set import extraction_dir, prepare, render

DEMO_CONFIG = REPO / "config" / "demo.toml"
SGLANG_CONFIG = REPO / "config" / "demo-sglang.toml"
# The real server's context, as the simulator's: no prompt of the partition comes near it.
SGLANG_CONTEXT = 8192
# Small shards so the progress shows; the tiny model keeps the CPU forward to a few seconds.
EXTRACT_ENV = {"DATAGEN_SHARD_SAMPLES": "64", "DATAGEN_EXTRACT_BATCH_TOKENS": "2048",
               "DATAGEN_EXTRACT_WRITER_THREADS": "2"}
SIMULATOR_ARGS = ["--max-running-requests", "48", "--mean-output-tokens", "300",
                  "--sigma", "0.8", "--decode-step-s", "0.004", "--prefill-tokens-per-s",
                  "200000", "--context-length", "8192", "--seed", "7"]


def run_demo(args: argparse.Namespace) -> int:
    started = time.monotonic()
    # SIGTERM (a timeout, `kill`) unwinds like Ctrl-C, so the finally below stops the
    # server and workers: each runs in a session of its own and would outlive the demo.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    real = getattr(args, "server", "simulator") == "sglang"
    if real and sglang.unavailable_reason():
        print(f"demo --server sglang: {sglang.unavailable_reason()}")
        return 2
    config = SGLANG_CONFIG if real else DEMO_CONFIG
    workdir = Path(args.workdir).resolve()
    shutil.rmtree(workdir, ignore_errors=True)
    logs = workdir / "logs"
    logs.mkdir(parents=True)
    print(f"demo: working in {workdir} (logs in {logs})", flush=True)
    tokenizer = build_tiny_tokenizer(workdir / "tokenizer")
    encoder = ChatEncoder(tokenizer)
    procs: list[Process] = []
    with RedisServer(workdir=workdir / "redis") as redis_server:
        try:
            server, url = (_start_sglang(workdir, tokenizer, encoder.vocab_size) if real
                           else _start_simulator(workdir, encoder))
            procs.append(server)
            env = {"DATAGEN_CONFIG": str(config), "DATAGEN_REDIS_URL": redis_server.url,
                   "DATAGEN_SERVER_URL": url, "DATAGEN_OUTPUT_DIR": str(workdir / "output"),
                   "DATAGEN_TOKENIZER_PATH": str(tokenizer)}
            os.environ.update(env)
            print(f"demo: redis {redis_server.url}, {server.name} {url}", flush=True)
            workers = [start_worker(q, child_env(env), logs) for q in ("short", "long")]
            procs += workers
            wait_for_workers(redis_server.url, 2, procs=workers)
            print("demo: short and long workers are up", flush=True)
            _produce_and_follow(started, config, timeout_s=900 if real else 240)
            for proc in (*workers, server):  # generation is over: the CPU goes to extraction
                proc.stop()
            env.update(EXTRACT_ENV, DATAGEN_MODEL_PATH=str(workdir / "model"))
            os.environ.update(env)
            if not real:  # the real server served it already
                _build_model(workdir, tokenizer, encoder.vocab_size)  # the gpu worker checks it
            print("\nextraction: one gpu worker on the CPU", flush=True)
            procs.append(start_worker("gpu", child_env(env), logs))
            return _extract(started, config)
        finally:
            if not args.keep:
                for proc in reversed(procs):
                    proc.stop()


def _start_simulator(workdir: Path, encoder: ChatEncoder) -> tuple[Process, str]:
    return start_simulator(workdir / "logs", SIMULATOR_ARGS + [
        "--vocab-size", str(encoder.vocab_size), "--eos-token-id",
        str(encoder.eos_token_id), "--request-log", str(workdir / "requests.jsonl")])


def _start_sglang(workdir: Path, tokenizer: Path, vocab_size: int) -> tuple[Process, str]:
    """The demo's model, built now, served by a real SGLang (1-3 minutes to load)."""
    _build_model(workdir, tokenizer, vocab_size)
    requests_dir = workdir / "sglang-requests"
    requests_dir.mkdir()
    proc, url = sglang.start_sglang(workdir / "model", workdir / "logs", "sglang",
                                    SGLANG_CONTEXT, requests_dir)
    print(f"demo: starting a real SGLang {sglang.SGLANG_VERSION} on the CPU ({url}; "
          f"log {proc.log_path}); it takes 1-3 minutes to load", flush=True)
    waited = sglang.wait_healthy(url, proc.alive, proc.log_path)
    print(f"demo: SGLang healthy after {waited:.0f}s", flush=True)
    return proc, url


def _produce_and_follow(started: float, config: Path, timeout_s: float) -> int:
    from producers.producer import Producer  # noqa: PLC0415

    settings = load_settings(config)
    app = make_app(settings)
    ledger = Ledger.from_settings(settings)
    reports = Producer(settings, app, ledger).run()
    print(render_produce(reports), flush=True)
    table = follow(ledger, 1.0, app=app, timeout_s=timeout_s)
    print("\nsummary")
    print_summary(ledger, table)
    merge_all(settings, ledger)
    closed = [r.dataset for r in table if r.state.startswith("closed")]
    print(f"\ngeneration finished in {time.monotonic() - started:.0f}s; closed by budget: "
          f"{', '.join(closed) or 'none'}; records under {settings.output_dir}", flush=True)
    return 0


DEMO_LAYERS = 8


def _build_model(workdir: Path, tokenizer: Path, vocab_size: int) -> None:
    from transformers.utils import logging as hf_logging  # noqa: PLC0415

    from datagen.builders.tiny_model import build_tiny_llama  # noqa: PLC0415 (torch)

    print("\ndemo: a tiny random Llama (8 layers) as the target model", flush=True)
    hf_logging.disable_progress_bar()
    # 8 layers, so SpecForge's default aux layers [1, N//2-1, N-4] are three different ones
    # ([1, 3, 4]), as on every real target; 6 would train the drafter on [1, 2, 2].
    build_tiny_llama(workdir / "model", vocab_size, num_layers=DEMO_LAYERS, tokenizer_dir=tokenizer)


def _extract(started: float, config: Path) -> int:
    settings = load_settings(config)
    tset = prepare(settings, committed_maps(settings), decoder(settings))
    print(render(tset), flush=True)
    code = cmd_extract(settings, argparse.Namespace(force=False, no_wait=False, interval=1.0,
                                                    timeout_s=240, hidden_size=None))
    out = extraction_dir(settings)
    print(_check_one_file(out, tset.shards[0]["path"], settings.output_dir))
    print(f"\ndemo finished in {time.monotonic() - started:.0f}s\n"
          f"  training set (shards, manifest):    {tset.directory}\n"
          f"  pre-tokenized rows (online, exact): {tset.online_rows}\n"
          f"  conversations (online, lossy):      {tset.conversations}\n"
          f"  SpecForge handoff (offline):        {out}  (data_<idx>.ckpt under rows_*/, "
          f"{handoff.RUN_CONFIG_NAME})")
    return code


def _check_one_file(out: Path, shard: str, output_dir: str) -> str:
    """Load the first sample's file and compare it with its record, as SpecForge reads it."""
    import json  # noqa: PLC0415

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
