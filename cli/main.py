"""`datagen`: one command line for every step of a run."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import redis

from config.settings import Settings, SettingsError, load_settings, masked_url
from datagen.errors import DatagenError, LedgerUnavailable

log = logging.getLogger("datagen")

# Flags users of the original single-process script know, mapped to settings fields.
RUN_FLAGS: dict[str, tuple[str, Any]] = {
    "--partition": ("partition", str),
    "--data-dir": ("data_dir", str),
    "--output-dir": ("output_dir", str),
    "--server-url": ("server_url", str),
    "--redis-url": ("redis_url", str),
    "--tokenizer": ("tokenizer_path", str),
    "--short-concurrency": ("short_concurrency", int),
    "--short-max-tokens": ("short_max_tokens", int),
    "--long-concurrency": ("long_concurrency", int),
    "--long-max-tokens": ("long_max_tokens", int),
    "--long-threshold": ("long_threshold_tokens", int),
    "--context-length": ("context_length", int),
    "--token-budget": ("token_budget", int),
    "--max-samples": ("max_samples", int),
}


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML settings file (also $DATAGEN_CONFIG)")
    for flag, (field, kind) in RUN_FLAGS.items():
        parser.add_argument(flag, dest=field, type=kind, default=None)
    parser.add_argument("--budget-counts", dest="budget_counts",
                        choices=("completion", "total"), default=None)


def settings_from(args: argparse.Namespace) -> Settings:
    overrides = {field: getattr(args, field, None) for field, _ in RUN_FLAGS.values()}
    overrides["budget_counts"] = getattr(args, "budget_counts", None)
    settings = load_settings(args.config, overrides=overrides)
    # Child processes (workers started from here) must load exactly these settings.
    if args.config:
        os.environ["DATAGEN_CONFIG"] = os.path.abspath(args.config)
    for field, value in overrides.items():
        if value is not None:
            os.environ[f"DATAGEN_{field.upper()}"] = str(value)
    return settings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="datagen", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {
        "produce": "tokenize the datasets and enqueue every sample not done yet",
        "run": "produce, then follow progress until every dataset is done or closed",
        "status": "where every dataset stands (budget, tokens, samples, state)",
        "dead": "the samples given up on, per dataset, grouped by reason",
        "merge": "merge the workers' records into raw_responses.jsonl per dataset",
        "budget": "show or change a dataset's budget while the run goes on",
        "recover": "rebuild the ledger from the records on disk and re-enqueue what is missing",
        "sweep": "re-enqueue samples whose queue message was lost",
        "worker": "start a Celery worker for a queue with the concurrency from the settings",
        "flower": "start Flower with authentication",
        "config": "print the effective settings (secrets masked)",
        "demo": "run the whole pipeline on the bundled demo partition",
        "metrics": "serve the ledger as Prometheus metrics on /metrics",
        "plot": "draw committed tokens per dataset over time against the budgets (PNG)",
        "prepare": "merge, filter, deduplicate, shuffle and shard the records into the "
                   "training set",
        "extract": "enqueue hidden-state extraction of every shard not done, follow progress",
        "estimate": "disk bytes and hours of hidden-state extraction, with the arithmetic",
        "calibrate": "measure extraction tokens/s on this machine's device and store it",
    }
    parsers = {}
    for name, text in commands.items():
        parsers[name] = p = sub.add_parser(name, help=text, description=text,
                                           allow_abbrev=False)
        _add_settings_flags(p)
    parsers["status"].add_argument("--watch", action="store_true")
    parsers["status"].add_argument("--json", action="store_true")
    parsers["status"].add_argument("--interval", type=float, default=2.0)
    parsers["run"].add_argument("--interval", type=float, default=2.0)
    parsers["run"].add_argument("--strict", action="store_true",
                                help="exit 3 when input lines were skipped as bad")
    parsers["dead"].add_argument("dataset", nargs="?", help="one dataset (default: all)")
    parsers["dead"].add_argument("--json", action="store_true")
    parsers["merge"].add_argument("--include-uncommitted", action="store_true")
    parsers["budget"].add_argument("dataset", nargs="?")
    parsers["budget"].add_argument("tokens", nargs="?", type=int)
    parsers["worker"].add_argument("queue", choices=("short", "long", "gpu"))
    parsers["worker"].add_argument("--gpus", help="gpu: one replica's devices, 0-7 or cpu:2 "
                                                  "(the gpus setting)")
    parsers["worker"].add_argument("--backend", dest="extract_backend",
                                   choices=("hf", "hf-tp", "sglang"),
                                   help="gpu: the extract_backend setting")
    # Celery's own options (-n, --loglevel, ...) may follow; settings flags work anywhere.
    parsers["flower"].add_argument("--port", type=int, default=5555)
    parsers["flower"].add_argument("--address", default="127.0.0.1")
    parsers["metrics"].add_argument("--port", type=int, default=9108)
    parsers["metrics"].add_argument("--address", default="127.0.0.1")
    parsers["plot"].add_argument("--out", help="PNG path (default <output_dir>/progress.png)")
    _add_extraction_flags(parsers)
    parsers["demo"].add_argument("--workdir", default="runs/demo")
    parsers["demo"].add_argument("--keep", action="store_true",
                                 help="leave Redis, simulator and workers running")
    return parser


def _add_extraction_flags(parsers: dict[str, argparse.ArgumentParser]) -> None:
    parsers["prepare"].add_argument("--force", action="store_true",
                                    help="rewrite the shards even if extraction started on "
                                         "a different training set")
    ext = parsers["extract"]
    ext.add_argument("--force", action="store_true", help="start even if the disk check fails")
    ext.add_argument("--no-wait", action="store_true", help="enqueue and return")
    ext.add_argument("--interval", type=float, default=2.0)
    ext.add_argument("--timeout-s", type=float, default=None)
    ext.add_argument("--hidden-size", type=int, help="instead of the model's config.json")
    est = parsers["estimate"]
    est.add_argument("--tokens", action="append", metavar="N|DATASET=N",
                     help="token count to plan for (repeat for several datasets)")
    est.add_argument("--budgeted", action="store_true",
                     help="plan for the budgets instead of the tokens done")
    est.add_argument("--preset", choices=("kimi-k2.5", "kimi-k2", "deepseek-v3",
                                          "llama-3.1-8b", "llama-3.1-70b"),
                     help="the target's shape without its config.json (else model_path's)")
    est.add_argument("--hidden-size", type=int)
    est.add_argument("--num-layers", type=int)
    est.add_argument("--gpus", type=int, default=1,
                     help="gpu workers at once: GPUs, or replicas when calibrated on one")
    est.add_argument("--tokens-per-s", type=float,
                     help="per gpu worker (default: the calibration)")
    cal = parsers["calibrate"]
    cal.add_argument("--seq-len", type=int, default=4096)
    cal.add_argument("--batches", type=int, default=4)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("DATAGEN_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "worker":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.celery_args = extra
    try:
        settings = settings_from(args)
    except SettingsError as exc:
        print(f"datagen: bad settings: {exc}", file=sys.stderr)
        return 2
    from cli import commands  # noqa: PLC0415 (keeps `--help` fast)

    handler = getattr(commands, f"cmd_{args.command}")
    try:
        return int(handler(settings, args) or 0)
    except KeyboardInterrupt:
        return 130
    except (LedgerUnavailable, redis.exceptions.ConnectionError) as exc:
        print(f"datagen {args.command}: error: cannot reach Redis at redis_url "
              f"{masked_url(settings.redis_url)}: {exc}", file=sys.stderr)
        return 2
    except (DatagenError, ValueError, OSError, redis.exceptions.RedisError) as exc:
        # Bad partitions, unknown datasets, unreachable services: one clear line, no traceback.
        log.debug("command failed", exc_info=True)
        print(f"datagen {args.command}: error: {exc}", file=sys.stderr)
        return 2


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def describe(settings: Settings) -> str:
    return (f"redis {masked_url(settings.redis_url)}, server {masked_url(settings.server_url)},"
            f" output {settings.output_dir}, at {time.strftime('%H:%M:%S')}")


if __name__ == "__main__":
    sys.exit(main())
