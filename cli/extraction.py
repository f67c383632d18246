"""The extraction phase's subcommands: prepare, extract, handoff, estimate, calibrate.

Like every producer-side command they enqueue by task name and never import worker code or
torch (``calibrate`` is the exception: it runs the model on this machine, by design).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import redis

from config.settings import Settings
from datagen.celery_app import EXTRACT_TASK, make_app
from datagen.errors import PermanentError, StreamUnavailable
from datagen.extraction import ledger as xlm
from datagen.extraction import runner, tally
from datagen.extraction.estimate import (
    DTYPE_BYTES,
    PRESETS,
    check_disk,
    estimate,
    load_calibration,
)
from datagen.extraction.manifest import shard_name
from datagen.generation.committed import Committed
from datagen.generation.ledger import Ledger
from datagen.generation.merge import datasets_on_disk
from datagen.generation.records import (
    canonical,
    counted_tokens,
    iter_records,
    loss_spans,
    records_dir,
)
from datagen.servers import capture
from datagen.stream import ledger as stream_ledger
from datagen.stream.plane import PlaneInfo
from datagen.training import draft_config, handoff, training_set
from datagen.training.text_rows import TextRows

EXIT_INCOMPLETE = 3  # something was dead-lettered (as `produce` does for bad input)
LOST_AFTER_S = 3.0   # a shard seen nowhere this long had its message lost: send it again


def _ledger(settings: Settings) -> Ledger:
    return Ledger.from_settings(settings)


def cmd_prepare(settings: Settings, args: argparse.Namespace) -> int:
    committed = committed_maps(settings)
    tset = training_set.prepare(settings, committed, decoder(settings), force=args.force)
    print(training_set.render(tset))
    if isinstance(committed, CommittedMaps):
        prune_lost_states(committed.ledger, list(committed))
    elif (Path(settings.output_dir) / capture.STATES_DIR).is_dir():
        print("captured states of lost attempts kept: without the ledger, which are lost "
              "is not known")
    return 0


def prune_lost_states(ledger: Ledger, datasets: Sequence[str]) -> None:
    """Delete the state files no counted record names and no request in flight will
    (capture_states: attempts that finished on their server after they were lost)."""
    for dataset in datasets:
        files, size = capture.prune(ledger.settings.output_dir, dataset,
                                    lambda d=dataset: ledger.kept(d))
        if files:
            print(f"{dataset}: deleted {files} captured state files of lost attempts "
                  f"({size / 1e6:,.1f} MB)")


class CommittedMaps(Mapping[str, Committed | None]):
    """Per dataset the ledger's committed map (its hashes: 24 bytes a sample), read from
    Redis when asked: merge and prepare take one dataset at a time, so one is held."""

    def __init__(self, ledger: Ledger, datasets: list[str]):
        self.ledger, self._datasets = ledger, datasets

    def __getitem__(self, dataset: str) -> Committed | None:
        if dataset not in self._datasets:
            raise KeyError(dataset)
        return self.ledger.committed_index(dataset)

    def __iter__(self) -> Iterator[str]:
        return iter(self._datasets)

    def __len__(self) -> int:
        return len(self._datasets)


def committed_maps(settings: Settings) -> Mapping[str, Committed | None]:
    """``CommittedMaps`` of the datasets on disk; {} (every record counts) without Redis."""
    try:
        ledger = _ledger(settings)
        ledger.r.ping()
    except redis.RedisError as exc:
        print(f"Redis not reachable ({exc}): every record on disk counts, earliest copy per id")
        return {}
    return CommittedMaps(ledger, datasets_on_disk(settings.output_dir))


def decoder(settings: Settings) -> Callable[[], TextRows] | None:
    """What loads the tokenizer for the text rows (None: no tokenizer set). Loaded only when
    called: transformers and torch cost ~250 MB of memory."""
    path = settings.tokenizer_path or settings.model_path
    if not path:
        return None

    def load() -> TextRows:
        from datagen.tokenization.chat import ChatEncoder  # noqa: PLC0415

        # The prompts were rendered as server_kind's server renders a chat request; with
        # "auto" (the kind the producer asked the server) SGLang's rules are tried, and a row
        # they do not reproduce exactly is written as text (TextRows counts it inexact).
        kind = settings.server_kind if settings.server_kind != "auto" else "sglang"
        return TextRows(ChatEncoder(path, settings.chat_template_kwargs,
                                    settings.trust_remote_code, kind))

    return load


def model_shape(model_path: str) -> tuple[int, int]:
    """(hidden_size, num_hidden_layers) from a local model's config.json."""
    if not model_path:
        raise ValueError("model_path is not set: set it, or pass --hidden-size/--num-layers")
    config = draft_config.text_config(draft_config.read_target_config(model_path))
    return int(config["hidden_size"]), int(config["num_hidden_layers"])


def require_model_path(settings: Settings) -> None:
    """The gpu workers load the target model from model_path: refuse before any shard is
    taken rather than fail each one after it."""
    if not settings.model_path:
        raise ValueError("model_path is not set: the gpu workers load the target model from "
                         "it (model_path in the settings file, DATAGEN_MODEL_PATH)")
    if not Path(settings.model_path, "config.json").is_file():
        raise ValueError(f"model_path {settings.model_path!r}: no config.json there (a "
                         "transformers model folder is needed)")


def gpu_replica(settings: Settings, args: argparse.Namespace) -> int | None:
    """`datagen worker gpu --gpus 0-7`: a replica over N ranks (None: the one-device worker,
    as before). Refuses to start, with one line, when the devices are not there."""
    from datagen.extraction import replica  # noqa: PLC0415 (no torch until a check needs it)

    env = {}
    for name in ("gpus", "extract_backend"):
        if getattr(args, name, None):
            settings = settings.replace(**{name: getattr(args, name)})
            env[f"DATAGEN_{name.upper()}"] = getattr(args, name)  # for the ranks
    devices = replica.devices_of(settings)
    if devices is None:
        return None
    replica.check_start(settings, devices)
    if not replica.is_replica(settings, devices):
        if devices.kind == "cuda":  # one GPU with `hf`: the one-device worker on it
            os.environ["CUDA_VISIBLE_DEVICES"] = replica.rank_env(
                devices, 0, 0, dict(os.environ))["CUDA_VISIBLE_DEVICES"]
        return None
    return replica.launch(devices, list(args.celery_args or []), env)


def cmd_extract(settings: Settings, args: argparse.Namespace) -> int:
    require_model_path(settings)
    manifest = training_set.read_manifest(training_set.training_dir(settings.output_dir))
    shards = xlm.shard_states(manifest, settings)
    xl = xlm.ExtractionLedger(_ledger(settings).r)
    if settings.states_to == "stream":
        _reopen_lost(settings, xl, shards)
    done, dead, todo = xlm.split_shards(shards, xl)
    out = training_set.extraction_dir(settings)
    if not todo and not dead:
        print(f"all {len(shards)} shards done ({manifest['samples']:,} samples, "
              f"{manifest['tokens']:,} tokens): nothing to enqueue; {_where(settings, out)}")
        # the same exit as when it followed them to the end: 3 if any sample was dead-lettered
        # (a replica can finish the last shard before this command looks)
        finished = _finished(xl, shards, done, dead, 0.0, out, _where(settings, out))
        return _hand_off(settings, shards, finished)
    todo += dead  # a new `extract` gives dead-lettered shards another chance
    hidden = args.hidden_size or model_shape(settings.model_path)[0]
    need = 0 if settings.states_to == "stream" else check_disk(
        out, sum(s.tokens for s in todo), hidden, DTYPE_BYTES[settings.extract_dtype],
        override=args.force)
    if settings.states_to == "stream":
        stream_ledger.ask_epoch(xl.r, settings.stream_epoch)
    send = xlm.nowhere(todo, xl, EXTRACT_TASK)
    xl.forget_dead(s.path for s in send)
    app = make_app(settings)
    runner.enqueue(app, xl, [s.path for s in send])
    where = (f"streamed into SpecForge (epoch {settings.stream_epoch}), no files"
             if settings.states_to == "stream" else f"~{need / 1e9:,.1f} GB to write under {out}")
    print(f"{len(send)} shards enqueued, {len(todo) - len(send)} already queued or running, "
          f"{len(done)} done of {len(shards)}; {where}", flush=True)
    if args.no_wait:
        return 0
    return _hand_off(settings, shards, follow_extraction(xl, app, shards, args.interval,
                                                         args.timeout_s, out, settings))


def _reopen_lost(settings: Settings, xl: xlm.ExtractionLedger,
                 shards: list[xlm.ShardState]) -> None:
    """A segment holder lost since the last run took samples' states: their shards run again
    and restore them under their refs (datagen/stream/reopen.py)."""
    folder = stream_ledger.stream_dir(settings)
    if not (folder / "plane.json").exists():
        return  # no plane yet: nothing was published
    from datagen.stream.publisher import Publisher  # noqa: PLC0415 (loads torch)
    from datagen.stream.reopen import reopen_lost  # noqa: PLC0415
    from datagen.stream.sink import StreamSink  # noqa: PLC0415

    try:
        publisher = Publisher(PlaneInfo.read(folder))
    except Exception as exc:  # Mooncake's own errors: the plane is not there to stream into
        raise StreamUnavailable(f"the stream's plane ({folder / 'plane.json'}) does not answer "
                                f"({type(exc).__name__}: {exc}): start `datagen stream`") from exc
    sink = StreamSink(publisher, stream_ledger.StreamLedger(xl.r, settings.stream_epoch),
                      settings.stream_resident_bytes)
    lost, reopened = reopen_lost(sink, xl, shards, settings.output_dir)
    if lost:
        print(f"{len(lost)} published samples of epoch {settings.stream_epoch} lost their states "
              f"with a segment holder: {len(reopened)} shards run again and put them back "
              "under their refs; a consumer that failed on them resumes from its checkpoint "
              "(training.resume_from)", flush=True)


def _hand_off(settings: Settings, shards: list[xlm.ShardState], code: int) -> int:
    """The handoff once extraction finished with exit `code`; none while it is incomplete."""
    if settings.states_to == "stream":  # the consumer trained from the stream: no files
        return _stream_finished(settings, shards, code)
    if code:
        print("SpecForge handoff not written: extraction is incomplete")
        return code
    return write_handoff(settings, shards)


def _stream_finished(settings: Settings, shards: list[xlm.ShardState], code: int) -> int:
    """The epoch's counts; after the plane's last epoch with every shard done (dead-lettered
    samples included: they will never come) the channel is closed, so the consumer ends with
    fewer steps than its horizon instead of waiting for refs that will not come."""
    r = _ledger(settings).r
    folder = stream_ledger.stream_dir(settings)
    ledger = stream_ledger.StreamLedger(r, settings.stream_epoch)
    print(stream_ledger.describe(ledger.refreshed(stream_ledger.consumer_state(folder)),
                                 settings.stream_resident_bytes))
    _, dead, todo = xlm.split_shards(shards, xlm.ExtractionLedger(r))
    if dead or todo:
        print(f"stream epoch {settings.stream_epoch} incomplete: {len(dead)} shards "
              f"dead-lettered, {len(todo)} to do; `datagen extract` again to finish it")
        return code or EXIT_INCOMPLETE
    plane = PlaneInfo.read(folder)
    if settings.stream_epoch >= plane.epochs:
        from datagen.stream.publisher import close_channel  # loads torch: only here

        close_channel(plane.channel_path)
        print(f"stream closed after epoch {settings.stream_epoch} of {plane.epochs}: the "
              "consumer ends once it has trained on what was published")
    return code


def write_handoff(settings: Settings, shards: list[xlm.ShardState]) -> int:
    """vocab_mapping.pt, draft_config.json and the run config next to the files, then the
    folder and the `specforge train` line that trains on it."""
    try:
        made = handoff.write_handoff(
            training_set.extraction_dir(settings), [shard_name(s.path) for s in shards],
            settings.model_path, settings.draft_vocab_size, settings.train_max_length,
            settings.trust_remote_code)
    except (ValueError, ImportError) as exc:
        print(f"SpecForge handoff not written: {exc}")
        return EXIT_INCOMPLETE
    print(handoff.describe(made))
    return 0


def cmd_handoff(settings: Settings, args: argparse.Namespace) -> int:
    """Write the handoff again (another draft_vocab_size, a moved model) from the counts."""
    require_model_path(settings)
    manifest = training_set.read_manifest(training_set.training_dir(settings.output_dir))
    return write_handoff(settings, xlm.shard_states(manifest))


def follow_extraction(xl: xlm.ExtractionLedger, app: Any, shards: list[xlm.ShardState],
                      interval: float, timeout_s: float | None, out: Path,
                      settings: Settings) -> int:
    """Print progress until every shard is done or dead-lettered; re-send lost shards."""
    started = time.monotonic()
    first = last_line = None
    nowhere_since: dict[str, float] = {}
    while True:
        done, dead, todo = xlm.split_shards(shards, xl)
        tokens = sum(s.tokens for s in done) + _partial_tokens(todo, xl.running())
        first = first if first is not None else tokens
        now = time.monotonic()
        if not todo:
            return _finished(xl, shards, done, dead, now - started, out,
                             _where(settings, out))
        if last_line is None or now - last_line >= max(interval, 10.0):
            last_line = now
            print(_extract_line(len(done), len(shards), tokens, shards, first, now - started),
                  flush=True)
        nowhere_since = _resend_lost(xl, app, todo, nowhere_since, now)
        # with every gpu worker down, their shards are still handed back
        runner.reap(settings, xl, lambda shard, retry: runner.send_shard(app, shard, retry))
        if timeout_s is not None and now - started > timeout_s:
            raise TimeoutError(f"extraction not finished after {timeout_s:.0f}s")
        time.sleep(interval)


def _resend_lost(xl: xlm.ExtractionLedger, app: Any, todo: list[xlm.ShardState],
                 nowhere_since: dict[str, float], now: float) -> dict[str, float]:
    """A shard to do with no ledger entry at all (Redis lost it: every shard sent has one,
    and the reaper sends those again). Seen so for a few seconds in a row, it is sent again."""
    since = {s.path: nowhere_since.get(s.path, now) for s in xlm.nowhere(todo, xl, EXTRACT_TASK)}
    for path, first_seen in list(since.items()):
        if now - first_seen > LOST_AFTER_S:
            runner.enqueue(app, xl, [path], retry=True)
            print(f"{path}: not done, not running, not queued: enqueued again", flush=True)
            del since[path]
    return since


def _where(settings: Settings, out: Path) -> str:
    """Where the states went, for the closing line."""
    if settings.states_to == "stream":
        return f"streamed into SpecForge (epoch {settings.stream_epoch}), no state files"
    return f"files under {out}"


def _finished(xl: xlm.ExtractionLedger, shards: list[xlm.ShardState],
              done: list[xlm.ShardState], dead: list[xlm.ShardState], seconds: float,
              out: Path, where: str) -> int:
    results = xl.done()
    dead_samples = sum(int(results[s.path].get("failed", 0)) for s in done)
    left_out = sum(int(results[s.path].get("skipped_overlong", 0)) for s in done)
    print(f"extraction finished: {len(done)}/{len(shards)} shards, "
          f"{sum(s.samples for s in done):,} samples, {sum(s.tokens for s in done):,} tokens "
          f"in {seconds:.0f}s; {left_out} samples left out by train_max_length; "
          f"{dead_samples} samples and {len(dead)} shards dead-lettered; {where}")
    total = tally.run_total(out)
    tally.save(out, total)
    print(tally.describe(total))
    if dead or dead_samples:
        print(f"reasons in {out}/dead_letters.jsonl; `datagen extract` retries dead shards")
        return EXIT_INCOMPLETE
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
    if args.preset:
        preset = PRESETS[args.preset]
        hidden, layers = hidden or preset[0], layers or preset[1]
    if hidden is None or layers is None:
        shape = model_shape(settings.model_path)
        hidden, layers = hidden or shape[0], layers or shape[1]
    captured = args.capture or settings.capture_states
    bound = _stream_bound(settings, args)
    rate, rate_source = ((0.0, "none needed: states captured while generating (capture_states)")
                         if captured and (bound is None or args.epochs == 1)
                         else _tokens_per_s(settings, args))
    plan = estimate(tokens, hidden, layers, rate, args.gpus, DTYPE_BYTES[settings.extract_dtype],
                    captured, settings.keep_captured_states, settings.extract_writer_threads,
                    settings.train_max_length, bound, args.epochs)
    print(f"tokens: {source}\ntokens/s per GPU: {rate_source}")
    print(plan.text)
    for line in _generation_lines(settings, args, plan.total_tokens, rate):
        print(line)
    return 0


def _stream_bound(settings: Settings, args: argparse.Namespace) -> int | None:
    """The resident bound when the plan streams (--stream or states_to = "stream"), else None."""
    if not (args.stream or settings.states_to == "stream"):
        return None
    if args.resident_bytes is not None:
        return int(args.resident_bytes)
    return settings.stream_resident_bytes


def _generation_lines(settings: Settings, args: argparse.Namespace, extracted: int,
                      rate: float) -> list[str]:
    """Per dataset the tokens generated so far and those inside train_max_length (what
    trains), with the GPU hours of both phases: generation (with --generate-tokens-per-s)
    and extraction (the plan's rate; 0 with capture)."""
    done = _generated_and_trainable(settings)
    if not done:
        return []
    lines = [f"{'generated so far':<24}{'generated':>16}{'trainable':>16}{'share':>8}"]
    for ds, (gen, trains) in done.items():
        share = f"{100 * trains / gen:.0f}%" if gen else "-"
        lines.append(f"{ds:<24}{gen:>16,}{trains:>16,}{share:>8}")
    gen = sum(g for g, _ in done.values())
    trains = sum(t for _, t in done.values())
    lines.append(f"{'total':<24}{gen:>16,}{trains:>16,}"
                 f"{(f'{100 * trains / gen:.0f}%' if gen else '-'):>8}")
    if args.generate_tokens_per_s:
        hours = gen / args.generate_tokens_per_s * args.generate_gpus / 3600
        lines.append(f"generation GPU h = {gen:,} generated / {args.generate_tokens_per_s:,.0f} "
                     f"tokens/s per server x {args.generate_gpus} GPUs / 3600 = {hours:,.1f} "
                     f"({hours * trains / gen if gen else 0:,.1f} of them on what trains)")
    if rate:
        lines.append(f"extraction GPU h = {extracted:,} tokens / {rate:,.0f} tokens/s / 3600 = "
                     f"{extracted / rate / 3600:,.1f}")
    return lines


def _generated_and_trainable(settings: Settings) -> dict[str, tuple[int, int]]:
    """dataset -> (generated, trainable) tokens of its committed samples: the ledger's
    counters when it counts trainable tokens, else the records on disk."""
    try:
        ledger = _ledger(settings)
        stats = {ds: ledger.snapshot(ds)["stats"] for ds in ledger.datasets()}
    except redis.RedisError:
        stats = {}
    if stats and settings.budget_counts == "trainable":
        return {ds: (int(s.get("completion_tokens", 0)), int(s.get("tokens", 0)))
                for ds, s in stats.items()}
    out = {}
    for ds in datasets_on_disk(settings.output_dir):
        chosen, _, _ = canonical(iter_records(records_dir(settings.output_dir, ds)))
        out[ds] = (sum(int(r.get("completion_tokens") or len(r.get("output_ids") or []))
                       for r in chosen.values()),
                   sum(counted_tokens(r, "trainable", settings.train_max_length) or 0
                       for r in chosen.values()))
    return out


def _planned_tokens(settings: Settings, args: argparse.Namespace
                    ) -> tuple[dict[str, int], str]:
    if args.tokens:
        out: dict[str, int] = {}
        for item in args.tokens:
            name, _, count = item.rpartition("=")
            out[name or "given"] = out.get(name or "given", 0) + int(count)
        return out, "given"
    if args.budgeted:
        return _budgeted_tokens(settings)
    if prepared := _prepared_tokens(settings):
        return prepared
    try:
        ledger = _ledger(settings)
        snaps = [ledger.snapshot(ds) for ds in ledger.datasets()]
        done = {s["dataset"]: int(s["stats"].get("prompt_tokens", 0))
                + int(s["stats"].get("completion_tokens", 0)) for s in snaps}
        if done:
            return done, ("done (prompt + completion), from the ledger: before prepare's "
                          "train_max_length rule (after `datagen prepare`, what it keeps)")
    except redis.RedisError as exc:
        print(f"Redis not reachable ({exc}): counting the records on disk")
    return _tokens_on_disk(settings), ("done (prompt + completion), from the records on disk, "
                                       "less what train_max_length drops and cuts")


def _prepared_tokens(settings: Settings) -> tuple[dict[str, int], str] | None:
    """What extraction will run over once `datagen prepare` ran: each dataset's tokens less
    what the train_max_length rule drops and cuts (None before prepare)."""
    try:
        manifest = training_set.read_manifest(training_set.training_dir(settings.output_dir))
    except PermanentError:
        return None
    rule = manifest.get("length_rule", {})
    cuts = rule.get("datasets", {})
    kept = {ds: int(d["tokens"]) - int(cuts.get(ds, {}).get("dropped_tokens", 0))
            - int(cuts.get(ds, {}).get("cut_tokens", 0))
            for ds, d in manifest["datasets"].items()}
    return kept, (f"the prepared training set (after train_max_length "
                  f"{rule.get('train_max_length', '?')} drops and cuts), "
                  f"{training_set.training_dir(settings.output_dir)}")


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
    out = {}
    for ds in datasets_on_disk(settings.output_dir):
        chosen, _, _ = canonical(iter_records(records_dir(settings.output_dir, ds)))
        out[ds] = sum(_kept(settings, r) for r in chosen.values())
    if not out:
        raise ValueError(f"no records under {settings.output_dir}: pass --tokens or --budgeted")
    return out


def _kept(settings: Settings, record: dict[str, Any]) -> int:
    """A record's tokens that extraction will see: prepare's train_max_length rule."""
    prompt, output = record.get("prompt_ids") or [], record.get("output_ids") or []
    spans = tuple(tuple(span) for span in loss_spans(record) or ())
    kept, _ = handoff.kept_length(len(prompt), len(prompt) + len(output), settings.train_max_length,
                          settings.extract_overlong, spans)
    return kept


def _tokens_per_s(settings: Settings, args: argparse.Namespace) -> tuple[float, str]:
    if args.tokens_per_s:
        return args.tokens_per_s, f"{args.tokens_per_s:,.0f} (given)"
    path = calibration_file(settings)
    if not os.path.exists(path):
        raise ValueError(f"no calibration at {path}: run `datagen calibrate` on a GPU worker, "
                         "or pass --tokens-per-s")
    cal = load_calibration(path)
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(cal.measured_at))
    return cal.tokens_per_s, (f"{cal.tokens_per_s:,.0f} (calibrated on {cal.device_name}, "
                              f"{cal.model_path}, {when}; {path})")


def calibration_file(settings: Settings) -> str:
    return settings.calibration_path or os.path.join(settings.output_dir, "calibration.json")


def cmd_calibrate(settings: Settings, args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415 (this command runs the model on this machine)

    from datagen.extraction.estimate import save_calibration  # noqa: PLC0415
    from datagen.extraction.extractor import calibrate  # noqa: PLC0415 (loads the model here)

    if not settings.model_path:
        raise ValueError("model_path is not set (DATAGEN_MODEL_PATH, --config)")
    if settings.gpus or settings.extract_backend != "hf":
        return _calibrate_replica(settings, args)
    rate = calibrate(settings.model_path, args.seq_len, args.batches,
                     device=settings.extract_device, dtype=settings.extract_dtype)
    cuda = torch.cuda.is_available() and settings.extract_device != "cpu"
    device = torch.cuda.get_device_name() if cuda else "cpu"
    path = calibration_file(settings)
    save_calibration(path, settings.model_path, device, rate)
    print(f"{rate:,.0f} tokens/s on {device} ({settings.extract_dtype}, {args.seq_len} tokens "
          f"x {args.batches}); stored in {path} for `datagen estimate`")
    return 0


def _calibrate_replica(settings: Settings, args: argparse.Namespace) -> int:
    """The same measurement on a whole replica (`gpus`, `extract_backend`): its ranks start
    as `datagen worker gpu` starts them; rank 0 measures and stores instead of consuming."""
    from datagen.extraction import replica  # noqa: PLC0415

    devices = replica.devices_of(settings)
    assert devices is not None  # gpus or a distributed backend is set
    replica.check_start(settings, devices)
    code = replica.launch(devices, [], {replica.CALIBRATE_ENV: f"{args.seq_len},{args.batches}",
                                        "DATAGEN_CALIBRATION_PATH": calibration_file(settings)})
    if code == 0:
        cal = load_calibration(calibration_file(settings))
        print(f"{cal.tokens_per_s:,.0f} tokens/s on {cal.device_name} ({settings.extract_dtype}, "
              f"{args.seq_len} tokens x {args.batches}); stored in {calibration_file(settings)} "
              "for `datagen estimate` (per replica)")
    return code
