"""The `datagen` subcommands. Each takes the effective settings and the parsed arguments."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys

from cli.extraction import (
    cmd_calibrate,
    cmd_estimate,
    cmd_extract,
    cmd_handoff,
    cmd_prepare,
    gpu_replica,
    require_model_path,
)
from cli.output import merge_all, print_json, print_summary, render_produce
from cli.stream import cmd_stream
from config.settings import Settings, settings_fields
from datagen.celery_app import make_app, worker_argv
from datagen.extraction import tally
from datagen.generation.follower import follow
from datagen.generation.guard import close, enqueue, wait_for_abort_passes
from datagen.generation.job import Job
from datagen.generation.ledger import Ledger
from datagen.generation.liveness import sweep
from datagen.generation.merge import datasets_on_disk
from datagen.operations import dead as dead_mod
from datagen.operations import status as status_mod
from datagen.stream import ledger as stream_ledger
from datagen.training import handoff
from datagen.training.training_set import extraction_dir

EXIT_BAD_INPUT = 3
# The extraction phase's subcommands live in cli/extraction.py; main dispatches through here.
__all__ = ["cmd_calibrate", "cmd_estimate", "cmd_extract", "cmd_handoff", "cmd_prepare",
           "cmd_stream"]


def _ledger(settings: Settings) -> Ledger:
    return Ledger.from_settings(settings)


def cmd_config(settings: Settings, args: argparse.Namespace) -> int:
    print_json(settings.public())
    return 0


def cmd_produce(settings: Settings, args: argparse.Namespace) -> int:
    from producers.producer import Producer  # noqa: PLC0415 (tokenizer loads lazily)

    producer = Producer(settings, make_app(settings), _ledger(settings))
    reports = producer.run()
    print(render_produce(reports))
    return EXIT_BAD_INPUT if any(r.bad for r in reports) else 0


def cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    ledger = _ledger(settings)
    if args.json:
        print_json(status_mod.as_json(status_mod.rows(ledger)))
        return 0
    if not args.watch:
        print(status_mod.render(status_mod.rows(ledger)))
        ready = handoff.existing(extraction_dir(settings))
        if ready:  # a finished extraction: where to train from
            print(ready)
        checked = tally.saved(extraction_dir(settings))
        if checked:
            print(tally.describe(checked))
        for line in stream_ledger.status_lines(ledger.r, settings.stream_resident_bytes,
                                               stream_ledger.stream_dir(settings)):
            print(line)
        return 0
    follow(ledger, args.interval, until_finished=False)
    return 0


def cmd_dead(settings: Settings, args: argparse.Namespace) -> int:
    table = dead_mod.read(_ledger(settings), [args.dataset] if args.dataset else [])
    if args.json:
        print_json(dead_mod.as_json(table))
    else:
        print(dead_mod.render(table))
    return 0


def cmd_run(settings: Settings, args: argparse.Namespace) -> int:
    """Produce, follow to the end, merge. A run that finished exits 0 even when input lines
    were skipped (they are reported, loudly, at the end); ``--strict`` exits 3 then."""
    code = cmd_produce(settings, args)
    ledger = _ledger(settings)
    table = follow(ledger, args.interval, app=make_app(settings),
                   on_lost=lambda: cmd_produce(settings, args))
    print_summary(ledger, table)
    merge_all(settings, ledger)
    if code == EXIT_BAD_INPUT:
        print(f"the run finished, but input lines were skipped as bad: see "
              f"{os.path.join(settings.output_dir, 'reports')}/<dataset>.bad.txt",
              file=sys.stderr)
        return code if args.strict else 0
    return code


def cmd_merge(settings: Settings, args: argparse.Namespace) -> int:
    merge_all(settings, _ledger(settings), args.include_uncommitted)
    return 0


def cmd_budget(settings: Settings, args: argparse.Namespace) -> int:
    ledger = _ledger(settings)
    if args.dataset is None or args.tokens is None:
        print(status_mod.render(status_mod.rows(ledger)))
        return 0
    known = ledger.datasets()
    if args.dataset not in known:
        raise ValueError(f"unknown dataset {args.dataset!r} (known: {', '.join(known) or 'none'})")
    if args.tokens < 0:
        raise ValueError(f"budget {args.tokens} for {args.dataset}: must be >= 0 tokens "
                         "(0 closes the dataset)")
    app = make_app(settings)
    old = ledger.budget(args.dataset)
    ledger.set_budget(args.dataset, args.tokens)
    tokens = ledger.snapshot(args.dataset)["tokens"]
    if tokens >= args.tokens:
        close(app, ledger, args.dataset, "budget", settings.abort_on_close)
        wait_for_abort_passes()
        print(f"{args.dataset}: budget {old:,} -> {args.tokens:,}; {tokens:,} tokens, closed")
        return 0
    if ledger.closed(args.dataset):
        ledger.reopen(args.dataset)
        print(f"{args.dataset}: budget {old:,} -> {args.tokens:,}; reopened, enqueueing what "
              "is missing")
        return cmd_produce(settings.replace(partition=args.dataset), args)
    for payload in ledger.unpark(args.dataset):  # parked samples may fit now
        enqueue(app, Job.from_payload(json.loads(payload)), retry=True)
    print(f"{args.dataset}: budget {old:,} -> {args.tokens:,}")
    return 0


def cmd_recover(settings: Settings, args: argparse.Namespace) -> int:
    """Rebuild the ledger from the records, then enqueue what is missing. Safe while
    workers run: without the run marker they hold their commits until it is back."""
    _ledger(settings).unmark_run()
    return cmd_produce(settings, args)


def cmd_sweep(settings: Settings, args: argparse.Namespace) -> int:
    app = make_app(settings)
    count = sweep(_ledger(settings), lambda job: enqueue(app, job))
    print(f"{count} samples re-enqueued")
    return 0


def cmd_worker(settings: Settings, args: argparse.Namespace) -> int:
    if args.queue == "gpu":
        require_model_path(settings)
        replica = gpu_replica(settings, args)
        if replica is not None:
            return replica
    argv = worker_argv(settings, args.queue) + list(args.celery_args or [])
    os.execv(argv[0], argv)
    return 1  # not reached


def cmd_flower(settings: Settings, args: argparse.Namespace) -> int:
    auth = settings.flower_basic_auth
    if not auth:
        auth = f"datagen:{secrets.token_urlsafe(12)}"
        print(f"Flower login (generated, set flower_basic_auth to choose): {auth}",
              flush=True)
    argv = [sys.executable, "-m", "datagen.operations.flower", f"--port={args.port}",
            f"--address={args.address}", f"--basic-auth={auth}"]
    os.execv(argv[0], argv)
    return 1  # not reached


def cmd_metrics(settings: Settings, args: argparse.Namespace) -> int:
    from datagen.operations.metrics import serve_metrics  # noqa: PLC0415

    serve_metrics(settings, args.address, args.port)
    return 0


def cmd_plot(settings: Settings, args: argparse.Namespace) -> int:
    try:
        from datagen.operations.plot import plot_run, run_budgets  # noqa: PLC0415
    except ImportError as exc:
        print(f"datagen plot: needs matplotlib ({exc}); pip install 'datagen[plot]'",
              file=sys.stderr)
        return 2
    out = args.out or os.path.join(settings.output_dir, "progress.png")
    budgets = run_budgets(settings, datasets_on_disk(settings.output_dir))
    print(plot_run(settings.output_dir, budgets, out, measure=settings.budget_counts,
                   window=settings.train_max_length))
    return 0


def cmd_demo(settings: Settings, args: argparse.Namespace) -> int:
    from cli.demo import run_demo  # noqa: PLC0415

    return run_demo(args)


def config_reference() -> str:
    """Markdown table of every setting, its default and its environment variable."""
    lines = ["| setting | default | environment |", "|---|---|---|"]
    for name, default, env in settings_fields():
        lines.append(f"| `{name}` | `{default!r}` | `{env}` |")
    return "\n".join(lines)

