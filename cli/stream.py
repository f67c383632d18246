"""`datagen stream`: the Mooncake plane up, the SpecForge consumer's config written, its
command printed; then held until the consumer is done (or fails, or Ctrl-C)."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from pathlib import Path

from config.settings import Settings
from datagen.errors import BadInput
from datagen.stream import consumer as sc
from datagen.stream.plane import SEGMENT_BYTES, Plane, PlaneInfo, key_count
from datagen.training import handoff
from datagen.training.training_set import extraction_dir


def add_stream_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", type=int,
                   help="samples a stream publishes per epoch (the consumer's horizon; default:"
                        " the prepared training set's, counted with the draft vocabulary)")
    p.add_argument("--epochs", type=int, default=1, help="epochs of them (default 1)")
    p.add_argument("--stream-dir", help="folder of the plane and the consumer's channel "
                                        "(default <output_dir>/stream)")
    p.add_argument("--handoff", help="the handoff's run config to take the target, draft "
                                     "config and vocab mapping from (default "
                                     f"<extraction folder>/{handoff.RUN_CONFIG_NAME})")
    p.add_argument("--segment-mb", type=int,
                   help="the segment holder's bytes in MiB: the most the store holds at once "
                        "(default: twice stream_resident_bytes, at least "
                        f"{SEGMENT_BYTES >> 20})")
    p.add_argument("--cpu", action="store_true",
                   help="a consumer on a CPU: NO_SHARD and sdpa attention")


def cmd_stream(settings: Settings, args: argparse.Namespace) -> int:
    run_config = Path(args.handoff or extraction_dir(settings) / handoff.RUN_CONFIG_NAME)
    samples = args.samples
    if not args.handoff and (samples is None or not run_config.exists()):
        # no states yet: the draft vocabulary from the training set's ids (torch loads here)
        from datagen.stream.handoff import write_stream_handoff  # noqa: PLC0415

        made_now, counted = write_stream_handoff(settings)
        print(handoff.describe(made_now), flush=True)
        run_config, samples = made_now.run_config, samples or counted
    if samples is None:
        raise BadInput("--samples: needed with --handoff (the samples an epoch streams)")
    made = sc.read_handoff_config(run_config)  # before anything starts: a clear error
    stream_dir = Path(args.stream_dir or settings.stream_dir
                      or Path(settings.output_dir) / "stream")
    segment = segment_bytes(settings, args.segment_mb)
    with Plane(stream_dir, segment_bytes=segment, epochs=args.epochs) as info:
        body = sc.consumer_config(made, info, samples, args.epochs, cpu=args.cpu)
        config = sc.write_consumer_config(stream_dir, body)
        print(sc.describe(info, config), flush=True)
        if args.cpu:  # SpecForge's loss is a Triton kernel: a CPU runs the labelled stand-in
            print(f"  on a CPU: {cpu_line(config)}", flush=True)
        return _hold(info)


def cpu_line(config: Path) -> str:
    """The consumer's line on a CPU: SpecForge's trainer with its Triton loss swapped for the
    torch formula of the same file, the draft in float32 (datagen/stream/cpu_consumer.py)."""
    from datagen.stream.cpu_consumer import command  # noqa: PLC0415

    return f"{shlex.join(command(config))}  (a stand-in: torch loss, float32 draft)"


def segment_bytes(settings: Settings, segment_mb: int | None) -> int:
    """The holder's segment: the sink keeps the unacknowledged bytes under
    stream_resident_bytes, but SpecForge frees an acknowledged sample only at its loader's
    next gc() (a get's read lease blocks the release: up to ~15 s of samples above the bound,
    BENCHMARKS.md "What does streaming into SpecForge cost"), so the default is twice the
    bound. A smaller segment is taken, with a warning: SpecForge hard-pins every object (this
    Mooncake build has ``with_hard_pin``: never evicted), so a full segment fails the put,
    and the sink retries the shard."""
    twice = max(2 * settings.stream_resident_bytes, SEGMENT_BYTES)
    if segment_mb is None:
        return twice
    given = segment_mb << 20
    if given < 2 * settings.stream_resident_bytes:
        print(f"warning: --segment-mb {segment_mb} is under twice stream_resident_bytes "
              f"({settings.stream_resident_bytes:,} B): puts may wait on a full segment",
              file=sys.stderr, flush=True)
    return given


def _hold(info: PlaneInfo) -> int:
    """Keep the plane up until the consumer is done (0) or failed (1), or a signal (130).
    When done, the objects the store still holds (0 unless something leaked) are printed
    before the plane stops and takes them."""
    channel_path = info.channel_path
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        if Path(channel_path + ".consumer_done").exists():
            print(f"consumer done: the store holds {key_count(info)} objects; plane stopped",
                  flush=True)
            return 0
        failed = Path(channel_path + ".consumer_failed")
        if failed.exists():
            print(f"consumer failed: {failed.read_text(encoding='utf-8').strip()}", flush=True)
            return 1
        time.sleep(0.5)
    return 130
