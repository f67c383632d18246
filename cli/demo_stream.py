"""`make demo STREAM=1`: the demo's states streamed into SpecForge's consumer, two epochs, no
state files.

After generation and `prepare`, as `datagen stream` does: the draft vocabulary is counted from
the training set, the Mooncake plane (mooncake_master + a segment holder) comes up under
``<output_dir>/stream``, and the consumer's run config is written with the ``specforge train
--role consumer`` line a GPU host runs. On this CPU the consumer is that same SpecForge trainer
with its Triton loss swapped for the torch formula of the same file
(datagen/stream/cpu_consumer.py, a labelled stand-in). Then one gpu worker per epoch
(``states_to = "stream"``, ``stream_epoch`` 1, then 2) runs `datagen extract`: each sample's
states are checked and put into the store, and the worker waits whenever the trainer's
unacknowledged bytes would pass the demo's bound (``stream_resident_bytes``, small here so the
bound shows). Epoch 2 recomputes every state by prefill from the records, in another order.

The demo ends when the consumer has acknowledged what was published and stopped. It prints the
consumer's own ledger (consumer.sqlite): each sample acknowledged once per epoch; and it fails
if a state file was written, a sample was acknowledged twice or the store still holds objects.
"""

from __future__ import annotations

import argparse
import os
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from pathlib import Path

from cli.extraction import EXIT_INCOMPLETE, cmd_extract, committed_maps, decoder
from cli.stack import Process, child_env, start_worker
from cli.stream import cpu_line, segment_bytes
from config.settings import Settings, load_settings
from datagen.stream import consumer as sc
from datagen.stream import cpu_consumer
from datagen.stream.handoff import write_stream_handoff
from datagen.stream.plane import Plane, PlaneInfo, key_count
from datagen.training.training_set import extraction_dir, prepare, render

EPOCHS = 2
# The bound on what the trainer has not acknowledged: ~1/4 of an epoch's states at the demo's
# shapes, so extraction waits for the trainer (the bound at work) instead of running ahead.
RESIDENT_BYTES = 16 << 20
SEGMENT_MB = 64  # twice the bound, as `datagen stream` would take (cli/stream.py)
CONSUMER_START_S = 600  # bounds a consumer that hangs at start-up, never a wait relied on


def stream_env(output_dir: str, epoch: int) -> dict[str, str]:
    """The settings of a gpu worker and of `datagen extract` for one epoch of the stream."""
    return {"DATAGEN_STATES_TO": "stream", "DATAGEN_STREAM_DIR": str(stream_dir(output_dir)),
            "DATAGEN_STREAM_RESIDENT_BYTES": str(RESIDENT_BYTES),
            "DATAGEN_STREAM_EPOCH": str(epoch)}


def stream_dir(output_dir: str) -> Path:
    return Path(output_dir) / "stream"


def run_stream(config: Path, env: dict[str, str], logs: Path, procs: list[Process],
               timeout_s: float) -> int:
    """Prepare, the plane and the consumer up, then EPOCHS epochs streamed through the queue."""
    settings = load_settings(config)
    tset = prepare(settings, committed_maps(settings), decoder(settings))
    print(render(tset), flush=True)
    made, samples = write_stream_handoff(settings)
    folder = stream_dir(settings.output_dir)
    print(f"\nstream: {samples} samples x {EPOCHS} epochs into SpecForge's consumer, no state "
          f"files; the trainer's unacknowledged bytes bounded at {RESIDENT_BYTES >> 20} MiB",
          flush=True)
    os.environ.update(stream_env(settings.output_dir, 1))
    os.environ.setdefault("GLOG_minloglevel", "1")  # Mooncake's INFO lines: its logs only
    segment = segment_bytes(load_settings(config), SEGMENT_MB)
    with Plane(folder, segment_bytes=segment, epochs=EPOCHS) as info:
        body = sc.consumer_config(sc.read_handoff_config(made.run_config), info, samples,
                                  EPOCHS, cpu=True)
        consumer_config = sc.write_consumer_config(folder, body)
        print(sc.describe(info, consumer_config), flush=True)
        print(f"  on this CPU: {cpu_line(consumer_config)}", flush=True)
        consumer = cpu_consumer.start(consumer_config, logs / "consumer.log")
        try:
            _wait_consumer_up(info, consumer, logs / "consumer.log")
            code = 0
            for epoch in range(1, EPOCHS + 1):
                code = _epoch(config, env, logs, procs, epoch, timeout_s) or code
            if not Path(info.channel_path + ".closed").exists():
                print("demo: the stream is incomplete (above): the consumer is stopped before "
                      "its horizon", flush=True)
                return code or EXIT_INCOMPLETE
            code = _wait_consumer_done(info, consumer, logs / "consumer.log",
                                       timeout_s) or code
        finally:
            _stop(consumer)
        return _report(settings, info, samples) or code


def _epoch(config: Path, env: dict[str, str], logs: Path, procs: list[Process], epoch: int,
           timeout_s: float) -> int:
    """One gpu worker with stream_epoch = ``epoch`` and `datagen extract` of that epoch."""
    epoch_env = stream_env(env["DATAGEN_OUTPUT_DIR"], epoch)
    os.environ.update(epoch_env)
    print(f"\nstream epoch {epoch} of {EPOCHS}: one gpu worker on the CPU"
          + (", every state recomputed by prefill from the records, in another order"
             if epoch > 1 else ""), flush=True)
    worker = start_worker("gpu", child_env({**env, **epoch_env}), logs)
    procs.append(worker)
    try:
        return cmd_extract(load_settings(config), argparse.Namespace(
            force=False, no_wait=False, interval=2.0, timeout_s=timeout_s, hidden_size=None))
    finally:
        worker.stop()
        procs.remove(worker)


def _wait_consumer_up(info: PlaneInfo, consumer: subprocess.Popen[bytes], log: Path) -> None:
    quantum = Path(info.channel_path + ".consumer_quantum")
    deadline = time.monotonic() + CONSUMER_START_S
    while not quantum.exists():
        if consumer.poll() is not None:
            raise RuntimeError(f"the consumer exited at start-up; its log {log}:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the consumer did not come up in {CONSUMER_START_S}s ({log})")
        time.sleep(0.2)
    print(f"demo: the consumer is up (log {log})", flush=True)


def _wait_consumer_done(info: PlaneInfo, consumer: subprocess.Popen[bytes], log: Path,
                        timeout_s: float) -> int:
    """The consumer ends once it trained on what was published (the channel is closed after
    the last epoch): 0, or the exit code it failed with. ``timeout_s`` bounds a hang only."""
    try:
        code = consumer.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    if code != 0 or not Path(info.channel_path + ".consumer_done").exists():
        print(f"demo: the consumer exited {code} without finishing; its log {log}:\n"
              f"{log.read_text(errors='replace')[-3000:]}", flush=True)
        return code or EXIT_INCOMPLETE
    return 0


def _stop(consumer: subprocess.Popen[bytes]) -> None:
    """The consumer's whole group (it runs in a session of its own)."""
    if consumer.poll() is None:
        os.killpg(consumer.pid, signal.SIGTERM)
        try:
            consumer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(consumer.pid, signal.SIGKILL)
            consumer.wait()


def acked(db: Path) -> list[str]:
    """The sample ids the consumer acknowledged, from its own SQLite ledger."""
    with sqlite3.connect(db) as conn:
        return [r[0] for r in conn.execute("SELECT sample_id FROM acked")]


def _report(settings: Settings, info: PlaneInfo, samples: int) -> int:
    """What the consumer's own ledger says; EXIT_INCOMPLETE if a sample was acknowledged twice
    in an epoch, a state file was written or the store still holds objects."""
    ids = acked(info.db_path)
    per_epoch = Counter(i.rsplit("@e", 1)[1] for i in ids)
    twice = [i for i, n in Counter(ids).items() if n > 1]
    files = list(extraction_dir(settings).rglob("*.ckpt"))
    left = key_count(info)
    print("\nSpecForge's consumer acknowledged (its consumer.sqlite): " + ", ".join(
        f"epoch {e}: {per_epoch.get(str(e), 0)} of {samples}" for e in range(1, EPOCHS + 1))
        + f"; twice: {len(twice)}; state files written: {len(files)}; objects left in the "
        f"store: {left}", flush=True)
    return EXIT_INCOMPLETE if twice or files or left else 0

