"""What streaming states into SpecForge costs against the file build, and what disk it saves
(issue 45): the same samples, side by side in one run.

    .venv/bin/python bench/bench_stream.py          # ~4 min on 2 loaded cores (the consumer)
    .venv/bin/python bench/bench_stream.py --samples 32 --positions 512 --hidden 256

The samples are random bf16 states of a tiny Llama's shapes (``--hidden`` H, ``--positions``
T tokens a sample, aux [1,T,3H], final [1,T,H]) put together by ``files.sample_tensors``, the
file build's own tensors; the tiny Llama itself (8 layers, vocab 300) only gives the consumer
its target config, draft config and vocab mapping (the project's handoff). Three builds:

- ``file``: ``files.save_atomic`` of each sample to ``rows_*/data_*.ckpt`` (torch.save, fsync,
  rename, fsync the folder), as the extractor writes them.
- ``consumer``: a ``StreamSink`` (Redis ledger, resident bound) puts each sample through the
  plane's ``Publisher`` into the real Mooncake store (mooncake_master + segment holder on
  loopback) and the stock ``specforge train --role consumer`` (datagen/stream/cpu_consumer.py:
  SpecForge's CLI with its Triton loss swapped for the torch formula of the same file, a CPU
  stand-in) trains one optimizer step a sample on the tiny draft model and acknowledges it.
- ``store``: the same sink, plane and Publisher, and a consumer stand-in thread that only
  gets each published sample from the store and releases it: put + publish + get + release.

The rate of a stream is samples over the time from its first put to its last acknowledgement
(the consumer's start-up is not counted, it is reported apart). The bound is
``--bound-samples`` samples' bytes so that the producer waits for the trainer. A thread samples
every ``--poll-ms``: the ledger's resident bytes, the master's key count, and the bytes
allocated under the stream folder but the trainer's checkpoints (states: none; the channel,
the consumer's SQLite and the Mooncake logs are what is there); for the file build, the bytes
under its folder. Writes bench/results/stream_cpu.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.bench_capture_disk import PeakDisk, allocated  # noqa: E402
from datagen.extraction.files import Sample, sample_tensors, save_atomic  # noqa: E402
from datagen.generation.ledger import connect  # noqa: E402
from datagen.redis_server import RedisServer  # noqa: E402
from datagen.stream import consumer as sc  # noqa: E402
from datagen.stream import cpu_consumer  # noqa: E402
from datagen.stream.ledger import StreamLedger  # noqa: E402
from datagen.stream.plane import Plane, PlaneInfo, metrics  # noqa: E402
from datagen.stream.publisher import Publisher  # noqa: E402
from datagen.stream.sink import StreamSink, stream_bytes  # noqa: E402

VOCAB = 300
LAYERS = 8
AUX = [1, 3, 4]  # SpecForge's default for 8 layers
HANG_S = 1800  # bounds a hung consumer only
# A release inside the get's Mooncake read lease cannot remove the keys (-706): SpecForge
# parks them and its FeatureDataLoader retries them with store.gc() every 15 s (its default)
GC_INTERVAL_S = 15.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--positions", type=int, default=256, help="tokens a sample")
    p.add_argument("--hidden", type=int, default=256, help="the tiny Llama's hidden size")
    p.add_argument("--bound-samples", type=float, default=4,
                   help="stream_resident_bytes as this many samples' bytes")
    p.add_argument("--poll-ms", type=float, default=20.0)
    p.add_argument("--dir", default="", help="where to work (default: a temp folder)")
    p.add_argument("--keep", action="store_true", help="keep the work folder (logs)")
    p.add_argument("--out", default=str(REPO / "bench/results/stream_cpu.json"))
    return p.parse_args()


def make_samples(args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(args.samples):
        gen = torch.Generator().manual_seed(i)
        t = args.positions
        sample = Sample(idx=i, id=f"s{i}", dataset="A1", n_prompt=t // 4, truncated=False,
                        input_ids=torch.randint(0, VOCAB, (t,), generator=gen).tolist())
        aux = torch.randn(1, t, 3 * args.hidden, generator=gen).bfloat16()
        final = torch.randn(1, t, args.hidden, generator=gen).bfloat16()
        out.append(sample_tensors(sample, aux, final))
    return out


def write_handoff(root: Path, samples: list[dict[str, torch.Tensor]],
                  args: argparse.Namespace) -> Path:
    """The project's handoff for the tiny Llama (target, draft config, vocab mapping)."""
    from datagen.builders.tiny_model import build_tiny_llama
    from datagen.tokenization.tokenizer import build_tiny_tokenizer
    from datagen.training import handoff
    from datagen.training import vocab_mapping as vm

    tokenizer = build_tiny_tokenizer(root / "tokenizer")
    model = build_tiny_llama(root / "model", VOCAB, hidden_size=args.hidden,
                             num_layers=LAYERS, tokenizer_dir=tokenizer)
    folder = root / "features"
    counts = vm.count_samples((f"rows_0/data_{i}.ckpt", s["input_ids"].tolist(),
                               s["loss_mask"].tolist()) for i, s in enumerate(samples))
    vm.write_shard_counts(folder, "h-1", counts, {"aux_layer_ids": AUX,
                                                  "max_length": args.positions,
                                                  "dtype": "bfloat16"})
    return handoff.write_handoff(folder, ["h-1"], str(model), 64, args.positions).run_config


def file_build(root: Path, samples: list[dict[str, torch.Tensor]],
               args: argparse.Namespace) -> dict[str, Any]:
    out = root / "files"
    with PeakDisk([out], args.poll_ms / 1000) as peak:
        t0 = time.perf_counter()
        for i, tensors in enumerate(samples):
            save_atomic(out / "rows_0" / f"data_{i}.ckpt", tensors)
        seconds = time.perf_counter() - t0
    left = allocated(out)
    shutil.rmtree(out, ignore_errors=True)
    return {"build": "file", "seconds": round(seconds, 3),
            "samples_per_s": round(len(samples) / seconds, 2), "peak_disk_bytes": peak.peak,
            "left_disk_bytes": left}


class Sampler:
    """Polls the ledger's resident bytes, the master's key count and allocated bytes, and the
    stream's disk."""

    def __init__(self, ledger: StreamLedger, info: PlaneInfo, folders: list[Path],
                 poll_s: float):
        self.ledger, self.info, self.folders, self.poll_s = ledger, info, folders, poll_s
        self.peak_resident = self.peak_keys = self.peak_store = self.peak_disk = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        self.peak_resident = max(self.peak_resident, self.ledger.resident_bytes())
        master = metrics(self.info.metrics_url)
        self.peak_keys = max(self.peak_keys, int(master["master_key_count"]))
        self.peak_store = max(self.peak_store, int(master["master_allocated_bytes"]))
        self.peak_disk = max(self.peak_disk, allocated(*self.folders))
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.sample()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


class GetReleaseConsumer:
    """The consumer stand-in of the ``store`` build: gets each ref the channel publishes from
    the Mooncake store and releases it at once (no training); ``acked()`` is what it released."""

    def __init__(self, info: PlaneInfo):
        from specforge.runtime.data_plane.mooncake_store import MooncakeFeatureStore
        from specforge.runtime.data_plane.streaming_ref_channel import StreamingRefChannel

        self.store = MooncakeFeatureStore(store_id=info.store_id,
                                          setup_kwargs=info.setup_kwargs())
        self.channel = StreamingRefChannel(info.channel_path)
        self.released: set[str] = set()
        self.got_bytes = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last_gc = time.monotonic()
        for ref in self.channel.stream(poll_s=0.005, idle_timeout_s=HANG_S):
            tensors, handle = self.store.get(ref)
            self.got_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
            self.store.release(handle)
            self.released.add(ref.sample_id)
            if time.monotonic() - last_gc >= GC_INTERVAL_S:  # as SpecForge's loader pumps it
                last_gc = time.monotonic()
                self.store.gc()

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join(HANG_S)


class StandInPublisher:
    """The plane's Publisher whose acks are the stand-in consumer's releases."""

    def __init__(self, publisher: Publisher, consumer: GetReleaseConsumer):
        self.publisher, self.consumer = publisher, consumer

    def put(self, sample_id: str, tensors: dict[str, torch.Tensor]) -> int:
        return self.publisher.put(sample_id, tensors)

    def acked(self) -> set[str]:
        return set(self.consumer.released)

    def consumer_done(self) -> bool:
        return False


def start_consumer(config: Path, log: Path) -> subprocess.Popen[bytes]:
    return cpu_consumer.start(config, log)


def wait_for(done: Any, what: str, proc: subprocess.Popen[bytes] | None = None,
             log: Path | None = None) -> None:
    deadline = time.monotonic() + HANG_S
    while not done():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the consumer exited ({proc.returncode}) before {what}: "
                               + (log.read_text()[-3000:] if log else ""))
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} in {HANG_S} s")
        time.sleep(0.01)


def stream_into(sink: StreamSink, ids: list[str], samples: list[dict[str, torch.Tensor]],
                sampler: Sampler, proc: subprocess.Popen[bytes] | None = None,
                log: Path | None = None) -> dict[str, Any]:
    """Puts through the bounded sink until every id is acknowledged; the times from the first
    put (the ledger stamps each acknowledgement with the wall clock)."""
    wall0, t0 = time.time(), time.perf_counter()
    for sid, tensors in zip(ids, samples, strict=True):
        sink.put(sid, tensors)
        sampler.sample()
    put_s = time.perf_counter() - t0

    def all_acked() -> bool:
        sink.refresh_acks()
        return sink.ledger.acked_ids() >= set(ids)

    wait_for(all_acked, "every sample acknowledged", proc, log)
    seconds = time.perf_counter() - t0
    stamps = sorted(float(t) - wall0 for t in sink.ledger.r.hvals(sink.ledger.acked_key))
    steady = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if stamps[-1] > stamps[0] else 0.0
    return {"seconds": round(seconds, 3), "samples_per_s": round(len(ids) / seconds, 2),
            "puts_s": round(put_s, 3), "first_ack_s": round(stamps[0], 3),
            "steady_samples_per_s": round(steady, 2)}


def stream_build(kind: str, root: Path, redis_url: str, samples: list[dict[str, torch.Tensor]],
                 handoff_config: Path, bound: int, args: argparse.Namespace) -> dict[str, Any]:
    stream = root / f"stream_{kind}"
    plane = Plane(stream, segment_bytes=max(256 << 20, 2 * bound))
    ledger = StreamLedger(connect(redis_url), epoch=1)
    ids = [f"A1/s{i}@e1" for i in range(len(samples))]
    proc = log = None
    extra: dict[str, Any] = {}
    with plane as info:
        try:
            publisher = Publisher(info)
            if kind == "consumer":
                body = sc.consumer_config(sc.read_handoff_config(handoff_config), info,
                                          samples=len(samples), cpu=True)
                log = root / "consumer.log"
                t_start = time.perf_counter()
                proc = start_consumer(sc.write_consumer_config(plane.dir, body), log)
                wait_for(lambda: publisher.channel.consumer_quantum() is not None,
                         "consumer quantum", proc, log)
                extra["consumer_start_s"] = round(time.perf_counter() - t_start, 2)
                sink = StreamSink(publisher, ledger, bound, poll_s=0.01)
            else:
                consumer = GetReleaseConsumer(info)
                consumer.start()
                sink = StreamSink(StandInPublisher(publisher, consumer), ledger, bound,
                                  poll_s=0.005)
            folders = [plane.dir / "consumer", plane.dir / "mooncake"]
            with Sampler(ledger, info, folders, args.poll_ms / 1000) as sampler:
                timing = stream_into(sink, ids, samples, sampler, proc, log)
            # what the store still holds once every sample is acknowledged: frees SpecForge
            # deferred (a live read lease) until its next gc
            extra["keys_after_acks"] = int(metrics(info.metrics_url)["master_key_count"])
            publisher.close()
            if proc is not None:
                if proc.wait(timeout=HANG_S) != 0:
                    raise RuntimeError(f"the consumer exited {proc.returncode}: {log}")
                extra["checkpoint_bytes"] = allocated(Path(body["output_dir"]))
            else:
                consumer.join()
                extra["got_bytes"] = consumer.got_bytes
        finally:
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    if not args.keep:
        shutil.rmtree(stream, ignore_errors=True)
    return {"build": kind, **timing, "peak_resident_bytes": sampler.peak_resident,
            "bound_bytes": bound, "peak_keys": sampler.peak_keys,
            "peak_store_allocated_bytes": sampler.peak_store, "polls": sampler.samples,
            "peak_disk_bytes": sampler.peak_disk, **extra}


def main() -> None:
    args = parse_args()
    # a SIGTERM (a timeout) unwinds: the plane, its consumer and Redis are stopped on the way
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_stream_"))
    root.mkdir(parents=True, exist_ok=True)
    samples = make_samples(args)
    sample_bytes = stream_bytes(samples[0])
    bound = int(args.bound_samples * sample_bytes)
    handoff_config = write_handoff(root, samples, args)
    runs = [file_build(root, samples, args)]
    with RedisServer(workdir=root / "redis") as srv:
        for kind in ("store", "consumer"):
            connect(srv.url).flushall()
            runs.append(stream_build(kind, root, srv.url, samples, handoff_config, bound, args))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.samples} samples x {args.positions} positions, H {args.hidden} (aux 3H, bf16), "
          f"{sample_bytes / 1e6:.2f} MB a sample in the store; bound {bound / 1e6:.2f} MB "
          f"({args.bound_samples:g} samples)")
    print("| build | samples/s | s | first ack s | steady samples/s | peak resident MB (ledger) "
          "| peak allocated MB (master) | bound MB | peak keys | peak disk MB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        resident = (f"{r['peak_resident_bytes'] / 1e6:.2f}" if "peak_resident_bytes" in r
                    else "-")
        bound_mb = f"{r['bound_bytes'] / 1e6:.2f}" if "bound_bytes" in r else "-"
        store = (f"{r['peak_store_allocated_bytes'] / 1e6:.2f}"
                 if "peak_store_allocated_bytes" in r else "-")
        print(f"| {r['build']} | {r['samples_per_s']:.2f} | {r['seconds']} | "
              f"{r.get('first_ack_s', '-')} | {r.get('steady_samples_per_s', '-')} | {resident} | "
              f"{store} | {bound_mb} | {r.get('peak_keys', '-')} | "
              f"{r['peak_disk_bytes'] / 1e6:.3f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "args": vars(args), "host": platform.node(), "cpus": os.cpu_count(),
        "samples_from": "random bf16 states of the tiny Llama's shapes (files.sample_tensors)",
        "sample_store_bytes": sample_bytes, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
