"""`datagen stream`: the Mooncake plane up, the SpecForge consumer's config written, its
command printed; then held until the consumer is done (or fails, or Ctrl-C)."""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path

from config.settings import Settings
from datagen.stream import consumer as sc
from datagen.stream.plane import SEGMENT_BYTES, Plane, PlaneInfo, key_count
from datagen.training import handoff
from datagen.training.training_set import extraction_dir


def add_stream_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samples", type=int, required=True,
                   help="samples a stream publishes per epoch (the consumer's horizon)")
    p.add_argument("--epochs", type=int, default=1, help="epochs of them (default 1)")
    p.add_argument("--stream-dir", help="folder of the plane and the consumer's channel "
                                        "(default <output_dir>/stream)")
    p.add_argument("--handoff", help="the handoff's run config to take the target, draft "
                                     "config and vocab mapping from (default "
                                     f"<extraction folder>/{handoff.RUN_CONFIG_NAME})")
    p.add_argument("--segment-mb", type=int, default=SEGMENT_BYTES >> 20,
                   help="the segment holder's bytes in MiB: the most the store holds at once "
                        f"(default {SEGMENT_BYTES >> 20})")
    p.add_argument("--cpu", action="store_true",
                   help="a consumer on a CPU: NO_SHARD and sdpa attention")


def cmd_stream(settings: Settings, args: argparse.Namespace) -> int:
    run_config = Path(args.handoff or extraction_dir(settings) / handoff.RUN_CONFIG_NAME)
    made = sc.read_handoff_config(run_config)  # before anything starts: a clear error
    stream_dir = Path(args.stream_dir or Path(settings.output_dir) / "stream")
    with Plane(stream_dir, segment_bytes=args.segment_mb << 20, epochs=args.epochs) as info:
        body = sc.consumer_config(made, info, args.samples, args.epochs, cpu=args.cpu)
        config = sc.write_consumer_config(stream_dir, body)
        print(sc.describe(info, config), flush=True)
        return _hold(info)


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
