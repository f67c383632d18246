"""`datagen`: one command line for every step of a run."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import redis

from config.settings import (
    BUDGET_MEASURES,
    Settings,
    SettingsError,
    load_settings,
    masked_url,
)
from datagen.errors import DatagenError, LedgerUnavailable

log = logging.getLogger("datagen")

# Flags users of the original single-process script know, mapped to settings fields. Each
# flag's help is its setting's own comment in config/settings.py.
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
    "--budget-counts": ("budget_counts", str),
    "--epoch": ("stream_epoch", int),
}
ALL_FLAGS = tuple(RUN_FLAGS)
LEDGER_FLAGS = ("--redis-url",)
# What may answer from a finished run's saved ledger (the saved_ledger setting): reads only.
SAVED_LEDGER_COMMANDS = ("status", "dead", "plot", "estimate")
# The settings flags each subcommand reads; the commands that produce (or start the processes
# that generate) take them all. `demo` brings its own settings.
COMMAND_FLAGS: dict[str, tuple[str, ...]] = {
    "produce": ALL_FLAGS, "run": ALL_FLAGS, "recover": ALL_FLAGS, "budget": ALL_FLAGS,
    "worker": ALL_FLAGS, "config": ALL_FLAGS,
    "status": LEDGER_FLAGS, "dead": LEDGER_FLAGS, "sweep": LEDGER_FLAGS,
    "flower": LEDGER_FLAGS, "metrics": LEDGER_FLAGS,
    "merge": (*LEDGER_FLAGS, "--output-dir"),
    "plot": (*LEDGER_FLAGS, "--output-dir", "--token-budget", "--budget-counts"),
    "prepare": (*LEDGER_FLAGS, "--output-dir", "--tokenizer"),
    "extract": (*LEDGER_FLAGS, "--output-dir", "--epoch"),
    "handoff": (*LEDGER_FLAGS, "--output-dir"),
    "estimate": (*LEDGER_FLAGS, "--output-dir", "--token-budget"),
    "calibrate": ("--output-dir",),
    "stream": ("--output-dir",),
    "demo": (),
}


def _setting_help() -> dict[str, str]:
    from config.reference import descriptions  # noqa: PLC0415

    source = Path(__file__).resolve().parent.parent / "config" / "settings.py"
    return descriptions(source.read_text(encoding="utf-8"))


def _add_settings_flags(parser: argparse.ArgumentParser, flags: Sequence[str],
                        text: Mapping[str, str]) -> None:
    if not flags:
        return
    group = parser.add_argument_group("settings (override the TOML file and DATAGEN_*)")
    group.add_argument("--config", metavar="FILE",
                       help="TOML settings file (also $DATAGEN_CONFIG)")
    for flag in flags:
        field, kind = RUN_FLAGS[flag]
        choices = BUDGET_MEASURES if field == "budget_counts" else None
        group.add_argument(flag, dest=field, type=kind, default=None, choices=choices,
                           metavar=None if choices else "N" if kind is int
                           else field.split("_")[-1].upper(),
                           help=f"{text.get(field, '')} (setting {field})")


def settings_from(args: argparse.Namespace) -> Settings:
    overrides = {field: getattr(args, field, None) for field, _ in RUN_FLAGS.values()}
    config = getattr(args, "config", None)
    settings = load_settings(config, overrides=overrides)
    # Child processes (workers started from here) must load exactly these settings.
    if config:
        os.environ["DATAGEN_CONFIG"] = os.path.abspath(config)
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
        "handoff": "write vocab_mapping.pt, the draft config and the SpecForge run config "
                   "next to the extracted files, and print the `specforge train` line",
        "estimate": "disk bytes and hours of hidden-state extraction, with the arithmetic",
        "calibrate": "measure extraction tokens/s on this machine's device and store it",
        "stream": "start the Mooncake plane, write SpecForge's consumer config and print "
                  "`specforge train --role consumer`; hold the plane until it is done",
    }
    parsers = {}
    setting_help = _setting_help()
    for name, text in commands.items():
        parsers[name] = p = sub.add_parser(name, help=text, description=text,
                                           allow_abbrev=False)
        _add_settings_flags(p, COMMAND_FLAGS[name], setting_help)
    parsers["status"].add_argument("--watch", action="store_true",
                                   help="redraw the table until interrupted")
    parsers["status"].add_argument("--json", action="store_true",
                                   help="print the rows as JSON instead of a table")
    parsers["status"].add_argument("--interval", type=float, default=2.0, metavar="S",
                                   help="seconds between redraws with --watch (default 2)")
    parsers["run"].add_argument("--interval", type=float, default=2.0, metavar="S",
                                help="seconds between progress lines (default 2)")
    parsers["run"].add_argument("--strict", action="store_true",
                                help="exit 3 when input lines were skipped as bad")
    parsers["dead"].add_argument("dataset", nargs="?", help="one dataset (default: all)")
    parsers["dead"].add_argument("--json", action="store_true",
                                 help="print the reasons as JSON instead of a table")
    parsers["merge"].add_argument("--include-uncommitted", action="store_true",
                                  help="also keep records the ledger never counted")
    parsers["budget"].add_argument("dataset", nargs="?",
                                   help="the dataset to change (none: show every budget)")
    parsers["budget"].add_argument("tokens", nargs="?", type=int,
                                   help="its new budget in tokens (0 closes it)")
    parsers["worker"].add_argument("queue", choices=("short", "long", "gpu"),
                                   help="the queue to consume; Celery's own options may follow")
    parsers["worker"].add_argument("--gpus", help="gpu: one replica's devices, 0-7 or cpu:2 "
                                                  "(the gpus setting)")
    parsers["worker"].add_argument("--backend", dest="extract_backend",
                                   choices=("hf", "hf-tp", "sglang", "vllm", "captured"),
                                   help="gpu: the extract_backend setting")
    # Celery's own options (-n, --loglevel, ...) may follow; settings flags work anywhere.
    for name, port in (("flower", 5555), ("metrics", 9108)):
        parsers[name].add_argument("--port", type=int, default=port,
                                   help=f"port to listen on (default {port})")
        parsers[name].add_argument("--address", default="127.0.0.1",
                                   help="address to bind (default 127.0.0.1, this host only)")
    parsers["plot"].add_argument("--out", help="PNG path (default <output_dir>/progress.png)")
    _add_extraction_flags(parsers)
    from cli.stream import add_stream_flags  # noqa: PLC0415

    add_stream_flags(parsers["stream"])
    parsers["demo"].add_argument("--workdir", default="runs/demo",
                                 help="folder of the demo run (default runs/demo)")
    parsers["demo"].add_argument("--server", choices=("simulator", "sglang", "vllm"),
                                 default="simulator",
                                 help="what generates: the SGLang simulator (default, fast), "
                                 "a real SGLang on the CPU (make sglang-env), or a real vLLM "
                                 "that captures the states as it generates (make vllm-env)")
    parsers["demo"].add_argument("--stream", action="store_true",
                                 help="stream the states into SpecForge's consumer (its "
                                 "Mooncake data plane, two epochs) instead of writing files")
    parsers["demo"].add_argument("--extract", choices=("hf", "vllm"), default="hf",
                                 help="what extracts: transformers (default) or a real vLLM "
                                 "engine on the CPU (make vllm-env; about a minute more)")
    return parser


def _add_extraction_flags(parsers: dict[str, argparse.ArgumentParser]) -> None:
    parsers["prepare"].add_argument("--force", action="store_true",
                                    help="rewrite the shards even if extraction started on "
                                         "a different training set (refused while its rows "
                                         "hold the only copy of captured states)")
    ext = parsers["extract"]
    ext.add_argument("--force", action="store_true", help="start even if the disk check fails")
    ext.add_argument("--no-wait", action="store_true", help="enqueue and return")
    ext.add_argument("--interval", type=float, default=2.0, metavar="S",
                     help="seconds between progress lines (default 2)")
    ext.add_argument("--timeout-s", type=float, default=None, metavar="S",
                     help="give up following after this long (the shards stay queued)")
    ext.add_argument("--hidden-size", type=int, help="instead of the model's config.json")
    est = parsers["estimate"]
    est.add_argument("--tokens", action="append", metavar="N|DATASET=N",
                     help="token count to plan for (repeat for several datasets)")
    est.add_argument("--budgeted", action="store_true",
                     help="plan for the budgets instead of the tokens done")
    est.add_argument("--preset", choices=("kimi-k2.5", "kimi-k2", "deepseek-v3",
                                          "llama-3.1-8b", "llama-3.1-70b"),
                     help="the target's shape without its config.json (else model_path's)")
    est.add_argument("--hidden-size", type=int, help="instead of the model's config.json")
    est.add_argument("--num-layers", type=int, help="instead of the model's config.json")
    est.add_argument("--gpus", type=int, default=1,
                     help="gpu workers at once: GPUs, or replicas when calibrated on one")
    est.add_argument("--tokens-per-s", type=float,
                     help="per gpu worker (default: the file `datagen calibrate` writes on a "
                          "GPU worker; on a machine with no calibration, e.g. a CPU-only one, "
                          "this flag is required)")
    est.add_argument("--generate-tokens-per-s", type=float,
                     help="tokens/s of one generation server (all its requests together): "
                          "prints the generation phase's GPU hours")
    est.add_argument("--generate-gpus", type=int, default=8,
                     help="GPUs of one generation server (default 8)")
    est.add_argument("--capture", action="store_true",
                     help="plan for capture_states (also when the settings turn it on): no "
                          "extraction forward, the captured files counted on disk")
    est.add_argument("--stream", action="store_true",
                     help="plan for streaming the states into SpecForge's data plane (also "
                          "when the settings say states_to = \"stream\"): no states on disk, "
                          "the store's resident bytes, a prefill per epoch")
    est.add_argument("--resident-bytes", type=int, metavar="N",
                     help="the stream's bound on the store's resident bytes (default: the "
                          "setting stream_resident_bytes)")
    est.add_argument("--epochs", type=int, default=1, metavar="N",
                     help="epochs the trainer runs over the stream (default 1)")
    cal = parsers["calibrate"]
    cal.add_argument("--seq-len", type=int, default=4096,
                     help="tokens per measured sequence (default 4096)")
    cal.add_argument("--batches", type=int, default=4,
                     help="forward batches to time after one warm-up (default 4)")


def _from_saved_ledger(handler: Callable[[Settings, argparse.Namespace], int | None],
                       settings: Settings, args: argparse.Namespace) -> int:
    """A read-only command on a finished run's saved ledger: a throwaway Redis on a copy."""
    from cli.saved import saved_ledger  # noqa: PLC0415

    print(f"datagen {args.command}: reading the ledger saved at {settings.saved_ledger} "
          "(saved_ledger), not redis_url", file=sys.stderr)
    with saved_ledger(Path(settings.saved_ledger)) as url:
        return int(handler(replace(settings, redis_url=url), args) or 0)


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
        if settings.saved_ledger and args.command in SAVED_LEDGER_COMMANDS:
            return _from_saved_ledger(handler, settings, args)
        return int(handler(settings, args) or 0)
    except KeyboardInterrupt:
        return 130
    except (LedgerUnavailable, redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError) as exc:
        print(f"datagen {args.command}: error: cannot reach Redis at redis_url "
              f"{masked_url(settings.redis_url)}: {exc}", file=sys.stderr)
        return 2
    except (DatagenError, ValueError, OSError, redis.exceptions.RedisError) as exc:
        # Bad partitions, unknown datasets, unreachable services: one clear line, no traceback.
        log.debug("command failed", exc_info=True)
        print(f"datagen {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
