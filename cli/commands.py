"""The `datagen` subcommands. Each takes the effective settings and the parsed arguments."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import redis

from config.settings import Settings, settings_fields
from datagen import status as status_mod
from datagen.celery_app import EXTRACT_TASK, make_app, worker_argv
from datagen.estimate import DTYPE_BYTES, check_disk, estimate, load_calibration
from datagen.guard import close, enqueue
from datagen.ledger import Ledger
from datagen.liveness import sweep
from datagen.merge import datasets_on_disk, merge_dataset
from datagen.recovery import rebuild_dataset

EXIT_BAD_INPUT = 3
STALL_SWEEP_S = 3.0


def _ledger(settings: Settings) -> Ledger:
    return Ledger.from_settings(settings)


def cmd_config(settings: Settings, args: argparse.Namespace) -> int:
    from cli.main import print_json  # noqa: PLC0415

    print_json(settings.public())
    return 0


def cmd_produce(settings: Settings, args: argparse.Namespace) -> int:
    from producers.producer import Producer  # noqa: PLC0415 (tokenizer loads lazily)

    producer = Producer(settings, make_app(settings), _ledger(settings))
    reports = producer.run()
    print(render_produce(reports))
    return EXIT_BAD_INPUT if any(r.bad for r in reports) else 0


def render_produce(reports: list[Any]) -> str:
    lines = [f"{'dataset':<14} {'read':>6} {'enqueued':>8} {'short':>6} {'long':>5} "
             f"{'done':>6} {'queued':>6} {'clamped':>7} {'skipped':>7}"]
    for r in reports:
        lines.append(f"{r.dataset:<14} {r.read:>6} {r.enqueued:>8} {r.short:>6} {r.long:>5} "
                     f"{r.already_done:>6} {r.already_queued:>6} {r.clamped:>7} "
                     f"{r.bad_count:>7}")
    for r in reports:
        for line in (r.rebuilt, r.skipped):
            if line:
                lines.append(line)
        for bad in r.bad[:10]:
            lines.append(f"  skipped {bad}")
        if r.bad_count > 10:
            lines.append(f"  ... {r.bad_count - 10} more in reports/{r.dataset}.bad.txt")
    total_bad = sum(r.bad_count for r in reports)
    lines.append(f"{sum(r.enqueued for r in reports)} enqueued, {total_bad} skipped as bad input")
    return "\n".join(lines)


def cmd_status(settings: Settings, args: argparse.Namespace) -> int:
    from cli.main import print_json  # noqa: PLC0415

    ledger = _ledger(settings)
    if args.json:
        print_json(status_mod.as_json(status_mod.rows(ledger)))
        return 0
    if not args.watch:
        print(status_mod.render(status_mod.rows(ledger)))
        return 0
    follow(ledger, args.interval, until_finished=False)
    return 0


def follow(ledger: Ledger, interval: float, until_finished: bool = True,
           app: Any = None, timeout_s: float | None = None) -> list[status_mod.Row]:
    """Redraw the status table until every dataset is finished (or forever)."""
    live = sys.stdout.isatty()
    previous: dict[str, tuple[float, int]] = {}
    started = time.monotonic()
    last_line = 0.0
    stalled_since: float | None = None
    while True:
        table = status_mod.rows(ledger, previous)
        previous = {r.dataset: (time.monotonic(), r.tokens) for r in table}
        if live:
            print("\x1b[2J\x1b[H" + status_mod.render(table, bars=True), flush=True)
        elif time.monotonic() - last_line >= max(interval, 10.0):
            last_line = time.monotonic()
            print(progress_line(table), flush=True)
        if until_finished and status_mod.finished(table):
            return table
        # Samples pending while nothing runs and the queues are empty: their messages
        # were lost (a worker killed right after taking one). Give them back.
        if app is not None and status_mod.stalled(table):
            stalled_since = stalled_since or time.monotonic()
            if time.monotonic() - stalled_since > STALL_SWEEP_S:
                sweep(ledger, lambda job: enqueue(app, job))
                stalled_since = None
        else:
            stalled_since = None
        if timeout_s is not None and time.monotonic() - started > timeout_s:
            raise TimeoutError(f"run not finished after {timeout_s:.0f}s")
        time.sleep(interval)


def progress_line(table: list[status_mod.Row]) -> str:
    parts = [f"{r.dataset} {r.tokens:,}/{r.budget:,} ({r.percent:.0f}%, {r.state})"
             for r in table]
    return time.strftime("%H:%M:%S ") + "; ".join(parts)


def cmd_run(settings: Settings, args: argparse.Namespace) -> int:
    code = cmd_produce(settings, args)
    ledger = _ledger(settings)
    table = follow(ledger, args.interval, app=make_app(settings))
    print(status_mod.render(table))
    _merge_all(settings, ledger)
    return code


def cmd_merge(settings: Settings, args: argparse.Namespace) -> int:
    _merge_all(settings, _ledger(settings), args.include_uncommitted)
    return 0


def _merge_all(settings: Settings, ledger: Ledger, include_uncommitted: bool = False) -> None:
    for dataset in datasets_on_disk(settings.output_dir):
        committed = ledger.r.hgetall(ledger.k(dataset, "done")) or None
        report = merge_dataset(settings.output_dir, dataset, committed, include_uncommitted)
        extra = f", {report.duplicates} duplicates dropped" if report.duplicates else ""
        if report.uncommitted:
            extra += f", {report.uncommitted} uncommitted left out"
        print(f"{dataset}: {report.records} records, {report.completion_tokens:,} completion "
              f"tokens -> {report.path}{extra}")


def cmd_budget(settings: Settings, args: argparse.Namespace) -> int:
    ledger = _ledger(settings)
    if args.dataset is None or args.tokens is None:
        print(status_mod.render(status_mod.rows(ledger)))
        return 0
    app = make_app(settings)
    old = ledger.budget(args.dataset)
    ledger.set_budget(args.dataset, args.tokens)
    tokens = ledger.snapshot(args.dataset)["tokens"]
    if tokens >= args.tokens:
        close(app, ledger, args.dataset, "budget", settings.abort_on_close)
        print(f"{args.dataset}: budget {old:,} -> {args.tokens:,}; {tokens:,} tokens, closed")
        return 0
    if ledger.closed(args.dataset):
        ledger.reopen(args.dataset)
        # Its queued tasks were revoked at the close: enqueue everything missing anew.
        ledger.r.delete(ledger.k(args.dataset, "pending"))
        print(f"{args.dataset}: budget {old:,} -> {args.tokens:,}; reopened, enqueueing what "
              "is missing")
        return cmd_produce(settings.replace(partition=args.dataset), args)
    print(f"{args.dataset}: budget {old:,} -> {args.tokens:,}")
    return 0


def cmd_recover(settings: Settings, args: argparse.Namespace) -> int:
    ledger = _ledger(settings)
    for dataset in datasets_on_disk(settings.output_dir):
        rebuilt = rebuild_dataset(ledger, dataset)
        print(rebuilt.line(ledger.budget(dataset)))
    return cmd_produce(settings, args)


def cmd_sweep(settings: Settings, args: argparse.Namespace) -> int:
    app = make_app(settings)
    count = sweep(_ledger(settings), lambda job: enqueue(app, job))
    print(f"{count} samples re-enqueued")
    return 0


def cmd_worker(settings: Settings, args: argparse.Namespace) -> int:
    argv = worker_argv(settings, args.queue) + list(args.celery_args or [])
    os.execv(argv[0], argv)
    return 1  # not reached


def cmd_flower(settings: Settings, args: argparse.Namespace) -> int:
    auth = settings.flower_basic_auth
    if not auth:
        auth = f"datagen:{secrets.token_urlsafe(12)}"
        print(f"Flower login (generated, set flower_basic_auth to choose): {auth}",
              flush=True)
    argv = [sys.executable, "-m", "celery", "-A", "datagen.celery_app", "flower",
            f"--port={args.port}", f"--address={args.address}", f"--basic-auth={auth}"]
    os.execv(argv[0], argv)
    return 1  # not reached


def cmd_metrics(settings: Settings, args: argparse.Namespace) -> int:
    from datagen.metrics import serve_metrics  # noqa: PLC0415

    serve_metrics(settings, args.address, args.port)
    return 0


def cmd_plot(settings: Settings, args: argparse.Namespace) -> int:
    try:
        from datagen.plot import plot_run, run_budgets  # noqa: PLC0415
    except ImportError as exc:
        print(f"datagen plot: needs matplotlib ({exc}); pip install matplotlib",
              file=sys.stderr)
        return 2
    out = args.out or os.path.join(settings.output_dir, "progress.png")
    budgets = run_budgets(settings, datasets_on_disk(settings.output_dir))
    print(plot_run(settings.output_dir, budgets, out, measure=settings.budget_counts))
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


# -- the extraction phase --------------------------------------------------------------------


def cmd_prepare(settings: Settings, args: argparse.Namespace) -> int:
    from datagen import training_set  # noqa: PLC0415

    tset = training_set.prepare(settings, _committed_maps(settings), _decoder(settings),
                                force=args.force)
    print(training_set.render(tset))
    return 0


def _committed_maps(settings: Settings) -> dict[str, dict[str, str] | None]:
    """Per dataset the ledger's committed map; {} (every record counts) without Redis."""
    try:
        ledger = _ledger(settings)
        return {ds: ledger.r.hgetall(ledger.k(ds, "done")) or None
                for ds in datasets_on_disk(settings.output_dir)}
    except redis.RedisError as exc:
        print(f"Redis not reachable ({exc}): every record on disk counts, earliest copy per id")
        return {}


def _decoder(settings: Settings) -> Any:
    path = settings.tokenizer_path or settings.model_path
    if not path:
        return None
    from datagen.tokenizer import ChatEncoder  # noqa: PLC0415

    encoder = ChatEncoder(path)
    # special tokens (eos, role markers) are the template's, not the assistant's text
    return lambda ids: encoder.decode(ids, skip_special_tokens=True)


def model_shape(model_path: str) -> tuple[int, int]:
    """(hidden_size, num_hidden_layers) from a local model's config.json."""
    if not model_path:
        raise ValueError("model_path is not set: set it, or pass --hidden-size/--num-layers")
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)  # multimodal checkpoints nest the LM's config
    return int(config["hidden_size"]), int(config["num_hidden_layers"])


def cmd_extract(settings: Settings, args: argparse.Namespace) -> int:
    from datagen import extraction_ledger as xlm  # noqa: PLC0415
    from datagen import training_set  # noqa: PLC0415

    manifest = training_set.read_manifest(training_set.training_dir(settings.output_dir))
    shards = xlm.shard_states(manifest)
    xl = xlm.ExtractionLedger(_ledger(settings).r)
    done, dead, todo = xlm.split_shards(shards, xl)
    out = training_set.extraction_dir(settings)
    if not todo and not dead:
        print(f"all {len(shards)} shards done ({manifest['samples']:,} samples, "
              f"{manifest['tokens']:,} tokens): nothing to enqueue; files under {out}")
        return 0
    todo += dead  # a new `extract` gives dead-lettered shards another chance
    hidden = args.hidden_size or model_shape(settings.model_path)[0]
    need = check_disk(out, sum(s.tokens for s in todo), hidden,
                      DTYPE_BYTES[settings.extract_dtype], override=args.force)
    send = xlm.nowhere(todo, xl, EXTRACT_TASK)
    xl.forget_dead(s.path for s in send)
    app = make_app(settings)
    for s in send:
        app.send_task(EXTRACT_TASK, kwargs={"shard": s.path}, queue=xlm.GPU_QUEUE)
    print(f"{len(send)} shards enqueued, {len(todo) - len(send)} already queued or running, "
          f"{len(done)} done of {len(shards)}; ~{need / 1e9:,.1f} GB to write under {out}",
          flush=True)
    if args.no_wait:
        return 0
    return follow_extraction(xl, app, shards, args.interval, args.timeout_s, out)


def follow_extraction(xl: Any, app: Any, shards: list[Any], interval: float,
                      timeout_s: float | None, out: Path) -> int:
    """Print progress until every shard is done or dead-lettered; re-send lost shards."""
    from datagen import extraction_ledger as xlm  # noqa: PLC0415

    started = time.monotonic()
    first = last_line = None
    nowhere_since: dict[str, float] = {}
    while True:
        done, dead, todo = xlm.split_shards(shards, xl)
        tokens = sum(s.tokens for s in done) + _partial_tokens(todo, xl.running())
        first = first if first is not None else tokens
        now = time.monotonic()
        if not todo:
            break
        if last_line is None or now - last_line >= max(interval, 10.0):
            last_line = now
            print(_extract_line(len(done), len(shards), tokens, shards, first, now - started),
                  flush=True)
        # A worker killed mid-shard took its message (early ack): once its lease lapses the
        # shard is nowhere. Seen so for a few seconds in a row, it is sent again.
        lost = {s.path: s for s in xlm.nowhere(todo, xl, EXTRACT_TASK)}
        nowhere_since = {p: nowhere_since.get(p, now) for p in lost}
        for path, since in list(nowhere_since.items()):
            if now - since > STALL_SWEEP_S:
                app.send_task(EXTRACT_TASK, kwargs={"shard": path}, queue=xlm.GPU_QUEUE)
                print(f"{path}: its worker is gone; enqueued again", flush=True)
                del nowhere_since[path]
        if timeout_s is not None and now - started > timeout_s:
            raise TimeoutError(f"extraction not finished after {timeout_s:.0f}s")
        time.sleep(interval)
    dead_samples = xl.dead_samples()
    print(f"extraction finished: {len(done)}/{len(shards)} shards, "
          f"{sum(s.samples for s in done):,} samples, {sum(s.tokens for s in done):,} tokens "
          f"in {time.monotonic() - started:.0f}s; {dead_samples} samples and {len(dead)} shards "
          f"dead-lettered; files under {out}")
    if dead or dead_samples:
        print(f"reasons in {out}/dead_letters.jsonl; `datagen extract` retries dead shards")
        return EXIT_BAD_INPUT
    return 0


def _partial_tokens(todo: list[Any], running: dict[str, dict[str, Any]]) -> int:
    total = 0
    for s in todo:
        p = running.get(s.path)
        if p and p.get("total"):
            total += int(s.tokens * min(1.0, p["handled"] / p["total"]))
    return total


def _extract_line(n_done: int, n_shards: int, tokens: int, shards: list[Any], first: int,
                  elapsed_s: float) -> str:
    total = sum(s.tokens for s in shards)
    rate = (tokens - first) / elapsed_s if elapsed_s > 0 else 0.0
    eta = f"{(total - tokens) / rate / 60:,.1f} min" if rate > 0 else "?"
    return (f"{time.strftime('%H:%M:%S')} extract: {n_done}/{n_shards} shards, "
            f"{tokens:,}/{total:,} tokens, {rate:,.0f} tokens/s, ETA {eta}")


def cmd_estimate(settings: Settings, args: argparse.Namespace) -> int:
    tokens, source = _planned_tokens(settings, args)
    hidden, layers = args.hidden_size, args.num_layers
    if hidden is None or layers is None:
        shape = model_shape(settings.model_path)
        hidden, layers = hidden or shape[0], layers or shape[1]
    rate, rate_source = _tokens_per_s(settings, args)
    plan = estimate(tokens, hidden, layers, rate, args.gpus, DTYPE_BYTES[settings.extract_dtype])
    print(f"tokens: {source}\ntokens/s per GPU: {rate_source}")
    print(plan.text)
    return 0


def _planned_tokens(settings: Settings, args: argparse.Namespace
                    ) -> tuple[dict[str, int], str]:
    if args.tokens:
        out: dict[str, int] = {}
        for item in args.tokens:
            name, _, count = item.rpartition("=")
            out[name or "total"] = out.get(name or "total", 0) + int(count)
        return out, "given"
    if args.budgeted:
        return _budgeted_tokens(settings)
    try:
        ledger = _ledger(settings)
        snaps = [ledger.snapshot(ds) for ds in ledger.datasets()]
        done = {s["dataset"]: int(s["stats"].get("prompt_tokens", 0))
                + int(s["stats"].get("completion_tokens", 0)) for s in snaps}
        if done:
            return done, "done (prompt + completion), from the ledger"
    except redis.RedisError as exc:
        print(f"Redis not reachable ({exc}): counting the records on disk")
    return _tokens_on_disk(settings), "done (prompt + completion), from the records on disk"


def _budgeted_tokens(settings: Settings) -> tuple[dict[str, int], str]:
    ledger = _ledger(settings)
    try:
        names = ledger.datasets() or datasets_on_disk(settings.output_dir)
        budgets = {ds: ledger.budget(ds) for ds in names}
        stats = [ledger.snapshot(ds)["stats"] for ds in names]
    except redis.RedisError:
        names = datasets_on_disk(settings.output_dir) or sorted(settings.budgets)
        budgets, stats = {ds: settings.budget_for(ds) for ds in names}, []
    if not budgets:
        raise ValueError("no datasets known: pass --tokens")
    prompt = sum(int(s.get("prompt_tokens", 0)) for s in stats)
    completion = sum(int(s.get("completion_tokens", 0)) for s in stats)
    if settings.budget_counts == "completion" and completion:
        scale = (prompt + completion) / completion  # extraction also runs over the prompts
        return ({ds: int(b * scale) for ds, b in budgets.items()},
                f"budgets x {scale:.3f} (prompt + completion over completion, measured so far)")
    note = "" if settings.budget_counts == "total" else " (completion only: prompts not counted)"
    return budgets, f"budgets{note}"


def _tokens_on_disk(settings: Settings) -> dict[str, int]:
    from datagen.records import canonical, iter_records, records_dir  # noqa: PLC0415

    out = {}
    for ds in datasets_on_disk(settings.output_dir):
        chosen, _, _ = canonical(iter_records(records_dir(settings.output_dir, ds)))
        out[ds] = sum(len(r.get("prompt_ids") or []) + len(r.get("output_ids") or [])
                      for r in chosen.values())
    if not out:
        raise ValueError(f"no records under {settings.output_dir}: pass --tokens or --budgeted")
    return out


def _tokens_per_s(settings: Settings, args: argparse.Namespace) -> tuple[float, str]:
    if args.tokens_per_s:
        return args.tokens_per_s, f"{args.tokens_per_s:,.0f} (given)"
    path = settings.calibration_path or os.path.join(settings.output_dir, "calibration.json")
    if not os.path.exists(path):
        raise ValueError(f"no calibration at {path}: run `datagen calibrate` on a GPU worker, "
                         "or pass --tokens-per-s")
    cal = load_calibration(path)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(cal.measured_at))
    return cal.tokens_per_s, (f"{cal.tokens_per_s:,.0f} (calibrated on {cal.device_name}, "
                              f"{cal.model_path}, {when}; {path})")


def cmd_calibrate(settings: Settings, args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415 (this command runs the model on this machine)

    from datagen.estimate import calibrate, save_calibration  # noqa: PLC0415

    if not settings.model_path:
        raise ValueError("model_path is not set (DATAGEN_MODEL_PATH, --config)")
    rate = calibrate(settings.model_path, args.seq_len, args.batches,
                     device=settings.extract_device, dtype=settings.extract_dtype)
    cuda = torch.cuda.is_available() and settings.extract_device != "cpu"
    device = torch.cuda.get_device_name() if cuda else "cpu"
    path = settings.calibration_path or os.path.join(settings.output_dir, "calibration.json")
    save_calibration(path, settings.model_path, device, rate)
    print(f"{rate:,.0f} tokens/s on {device} ({settings.extract_dtype}, {args.seq_len} tokens "
          f"x {args.batches}); stored in {path} for `datagen estimate`")
    return 0
