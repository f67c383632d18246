"""Throughput of hidden-state extraction: forward alone, a naive loop, the Extractor pipeline.

    python -m bench.bench_extract --out bench_extract.json                # 8B Llama shape, GPU
    python -m bench.bench_extract --seq-len 16384 --n-samples 8 --out long.json
    python -m bench.bench_extract --tiny --out tiny.json                  # CPU smoke run
    python -m bench.bench_extract --tiny --backend hf-tp --ranks 2 --out tp.json  # 2 CPU ranks

The model gets random weights built directly on the device in the target dtype (nothing is
saved or downloaded) and is handed to ``Extractor.from_model``. The pipeline writes real files
into a scratch folder and a background thread deletes each one as soon as it is complete, so
disk use stays bounded by the files in flight (the H200 hosts lent here have 64 GiB of disk).

Phases:
  forward   Extractor batches through the base model with aux hooks, no copies, no files
  naive     full HF forward(output_hidden_states=True) incl. LM head, .to("cpu"), torch.save,
            one sample after the other (what a first script does)
  pipeline  Extractor.run_shard: packed forward, pinned D2H copies, threaded atomic writes

``--backend hf-tp --ranks N`` saves the same random model to the scratch folder, starts N
ranks as a replica does (gloo on CPU, nccl on CUDA; rank 0 announces each row, every rank runs
it) and times the forward and pipeline phases on rank 0 (no naive phase).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("bench.bench_extract")

SHAPE_8B = dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
SHAPE_TINY = dict(hidden=64, layers=8, heads=4, kv_heads=2, intermediate=128, vocab=1000)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny model, CPU, float32")
    for name in SHAPE_8B:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None)
    p.add_argument("--dtype", default=None, help="default bfloat16 (float32 with --tiny)")
    p.add_argument("--device", default=None, help="default cuda if available (cpu with --tiny)")
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--n-samples", type=int, default=32)
    p.add_argument("--min-len", type=int, default=2048)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=None, help="fixed length (e.g. 16384)")
    p.add_argument("--naive-samples", type=int, default=8, help="naive loop is slow: a subset")
    p.add_argument("--batch-tokens", type=int, default=32768)
    p.add_argument("--writer-threads", type=int, default=4)
    p.add_argument("--work-dir", default=None, help="scratch folder for files (default: tmp)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="results JSON path")
    p.add_argument("--backend", choices=("hf", "hf-tp"), default="hf")
    p.add_argument("--ranks", type=int, default=1, help="hf-tp: ranks of the replica")
    p.add_argument("--rank-model", default=None, help=argparse.SUPPRESS)  # set for the ranks
    args = p.parse_args(argv)
    shape = SHAPE_TINY if args.tiny else SHAPE_8B
    for name, value in shape.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    return args


def build_model(args: argparse.Namespace, device: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from datagen.extraction.backends.hf import DTYPES

    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=max(32768, args.seq_len or 0),
                      tie_word_embeddings=False)
    cfg._attn_implementation = args.attn
    torch.manual_seed(args.seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[args.dtype])  # allocate in bf16 directly: 16 GB, not 32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def make_samples(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    out = []
    for i in range(args.n_samples):
        n = args.seq_len or rng.randint(args.min_len, args.max_len)
        n_prompt = max(1, n // 10)
        ids = [rng.randrange(args.vocab) for _ in range(n)]
        out.append({"idx": i, "id": f"bench-{i}", "dataset": "bench",
                    "prompt_ids": ids[:n_prompt], "output_ids": ids[n_prompt:]})
    return out


class Gpu:
    """Synchronize and peak-memory helpers that do nothing on CPU."""

    def __init__(self, device: Any):
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"
        self.device = device

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int | None:
        return self.torch.cuda.max_memory_allocated(self.device) if self.cuda else None


def phase_forward(ex: Any, samples: list[dict], gpu: Gpu) -> dict:
    from datagen.extraction.files import prepare

    prepared = [prepare(1, s, ex.cfg.max_length, "truncate", ex.vocab_size) for s in samples]
    batches = ex._batches(prepared)
    for batch in batches[:2]:  # warm-up: kernel selection, allocator and page-cache growth
        ex._forward_batch([s.input_ids for s in batch])
    gpu.sync()
    gpu.reset_peak()
    t0 = time.perf_counter()
    for batch in batches:
        ex._forward_batch([s.input_ids for s in batch])
    gpu.sync()
    tokens = sum(s.length for s in prepared)
    return _row(tokens, time.perf_counter() - t0, gpu.peak())


def phase_naive(model: Any, samples: list[dict], aux_ids: tuple[int, ...], work: Path,
                gpu: Gpu) -> dict:
    import torch

    gpu.reset_peak()
    tokens, size = 0, 0
    t0 = time.perf_counter()
    for s in samples:
        ids = s["prompt_ids"] + s["output_ids"]
        with torch.no_grad():
            out = model(torch.tensor([ids], device=gpu.device), output_hidden_states=True)
        hs = out.hidden_states
        aux = torch.cat([hs[i + 1] for i in aux_ids], dim=-1).to("cpu")
        final = hs[-1].to("cpu")
        path = work / f"naive_{s['idx']}.ckpt"
        torch.save({"input_ids": torch.tensor(ids), "aux_hidden_state": aux,
                    "hidden_state": final}, path)
        size += path.stat().st_size
        path.unlink()
        tokens += len(ids)
        del out, hs
    gpu.sync()
    return _row(tokens, time.perf_counter() - t0, gpu.peak(), size / max(tokens, 1))


class Deleter(threading.Thread):
    """Deletes complete data files as they appear; remembers the most bytes seen at once."""

    def __init__(self, folder: Path):
        super().__init__(daemon=True)
        self.folder, self.stop, self.max_bytes = folder, threading.Event(), 0

    def sweep(self) -> None:
        files = list(self.folder.glob("rows_*/data_*.ckpt"))
        in_use = sum(f.stat().st_size for f in files if f.exists())
        self.max_bytes = max(self.max_bytes, in_use)
        for f in files:
            f.unlink(missing_ok=True)

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.sweep()
        self.sweep()


def phase_pipeline(ex: Any, samples: list[dict], work: Path, gpu: Gpu) -> dict:
    shard = work / "bench_shard.jsonl"
    shard.write_text("".join(json.dumps(s) + "\n" for s in samples))
    deleter = Deleter(Path(ex.cfg.output_dir))
    deleter.start()
    gpu.reset_peak()
    try:
        res = ex.run_shard(shard)
    finally:
        deleter.stop.set()
        deleter.join()
    if res.failures:
        log.warning("pipeline failures: %s", res.failures[:3])
    row = _row(res.tokens, res.seconds, gpu.peak(), res.bytes / max(res.tokens, 1))
    row["max_disk_in_use_bytes"] = deleter.max_bytes
    return row


def _row(tokens: int, seconds: float, peak: int | None, disk_per_token: float | None = None
         ) -> dict:
    return {"tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
            "peak_gpu_bytes": peak, "disk_bytes_per_token": disk_per_token}


def print_table(results: dict) -> None:
    print(f"\n{results['shape']}  {results['dtype']} on {results['device_name']}, "
          f"backend {results.get('backend', 'hf')} x{results.get('ranks', 1)} ranks")
    print(f"{'phase':<10}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}{'peak GPU GiB':>14}"
          f"{'disk B/token':>14}")
    for name, r in results["phases"].items():
        peak = f"{r['peak_gpu_bytes'] / 2**30:.1f}" if r["peak_gpu_bytes"] else "-"
        disk = f"{r['disk_bytes_per_token']:,.0f}" if r["disk_bytes_per_token"] else "-"
        print(f"{name:<10}{r['tokens']:>10,}{r['seconds']:>10.2f}{r['tokens_per_s']:>12,.0f}"
              f"{peak:>14}{disk:>14}")


def run(args: argparse.Namespace) -> dict:
    import torch

    from datagen.extraction.backends.hf import resolve_device
    from datagen.extraction.extractor import ExtractionConfig, Extractor

    device = resolve_device(args.device or ("cpu" if args.tiny else "auto"))
    gpu = Gpu(device)
    t0 = time.perf_counter()
    model = build_model(args, device)
    gpu.sync()
    build_s = time.perf_counter() - t0
    samples = make_samples(args)
    work = Path(tempfile.mkdtemp(prefix="bench_extract_", dir=args.work_dir))
    max_len = max(len(s["prompt_ids"]) + len(s["output_ids"]) for s in samples)
    cfg = ExtractionConfig(model_path="<random>", output_dir=str(work / "out"),
                           dtype=args.dtype, device=str(device), max_length=max_len,
                           batch_tokens=args.batch_tokens, attn_implementation=args.attn,
                           writer_threads=args.writer_threads)
    try:
        with Extractor.from_model(model, cfg) as ex:
            phases = {"forward": phase_forward(ex, samples, gpu)}
            phases["naive"] = phase_naive(model, samples[:args.naive_samples],
                                          ex.aux_layer_ids, work, gpu)
            phases["pipeline"] = phase_pipeline(ex, samples, work, gpu)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{os.cpu_count()}"
    return {"shape": {k: getattr(args, k) for k in SHAPE_8B}, "dtype": args.dtype,
            "attn": args.attn, "device_name": name, "build_seconds": round(build_s, 2),
            "n_samples": args.n_samples, "seq_len": args.seq_len,
            "len_range": [args.min_len, args.max_len], "batch_tokens": args.batch_tokens,
            "phases": phases}


def run_replica(args: argparse.Namespace, argv: list[str]) -> dict | None:
    """The parent: save the random model, start the ranks, read rank 0's results."""
    import subprocess
    import sys

    import torch

    from datagen.extraction.replica import Devices, rank_env
    from datagen.redis_server import free_port

    cuda = (args.device or ("cpu" if args.tiny else "auto")) != "cpu" and (
        torch.cuda.is_available())
    work = Path(tempfile.mkdtemp(prefix="bench_extract_tp_", dir=args.work_dir))
    try:
        t0 = time.perf_counter()
        build_model(args, torch.device("cpu")).save_pretrained(work / "model")
        log.info("random model saved in %.1fs", time.perf_counter() - t0)
        devices = Devices("cuda" if cuda else "cpu", tuple(range(args.ranks)))
        port = free_port()
        procs = [subprocess.Popen([sys.executable, "-m", "bench.bench_extract", *argv,
                                   "--rank-model", str(work / "model")],
                                  env=rank_env(devices, r, port, dict(os.environ)))
                 for r in range(args.ranks)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"ranks exited with {codes}")
        return json.loads(Path(args.out).read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def rank_run(args: argparse.Namespace) -> dict | None:
    """One rank: its part of the model; rank 0 times the phases."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from datagen.extraction.backends import hf_tp
    from datagen.extraction.backends.hf import DTYPES
    from datagen.extraction.extractor import ExtractionConfig, Extractor
    from datagen.extraction.replica import Leader, follow

    cuda = os.environ["DATAGEN_REPLICA_DEVICE"] == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10))
    group = dist.new_group(backend="gloo", timeout=timedelta(hours=1))
    samples = make_samples(args)
    work = Path(tempfile.mkdtemp(prefix="bench_extract_rank_", dir=args.work_dir))
    max_len = max(len(s["prompt_ids"]) + len(s["output_ids"]) for s in samples)
    cfg = ExtractionConfig(model_path=args.rank_model, output_dir=str(work / "out"),
                           dtype=args.dtype, device=str(device), max_length=max_len,
                           batch_tokens=args.batch_tokens, attn_implementation=args.attn,
                           writer_threads=args.writer_threads, backend="hf-tp")
    backend = hf_tp.create(cfg, device)
    dist.barrier(group=group)
    try:
        if dist.get_rank() != 0:
            follow(backend, group, DTYPES[args.dtype])
            return None
        gpu = Gpu(device)
        with Extractor(cfg, backend=Leader(backend, group, timedelta(minutes=10))) as ex:
            phases = {"forward": phase_forward(ex, samples, gpu)}
            phases["pipeline"] = phase_pipeline(ex, samples, work, gpu)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    name = torch.cuda.get_device_name(device) if cuda else f"cpu x{os.cpu_count()}"
    return {"shape": {k: getattr(args, k) for k in SHAPE_8B}, "dtype": args.dtype,
            "attn": args.attn, "device_name": name, "backend": "hf-tp",
            "ranks": dist.get_world_size(), "n_samples": args.n_samples,
            "seq_len": args.seq_len, "len_range": [args.min_len, args.max_len],
            "batch_tokens": args.batch_tokens, "phases": phases}


def main(argv: list[str] | None = None) -> None:
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.rank_model:
        results = rank_run(args)
        if results is not None:
            Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        return
    if args.backend == "hf-tp":
        results = run_replica(args, argv)
    else:
        results = run(args)
        results["backend"], results["ranks"] = "hf", 1
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)


if __name__ == "__main__":
    main()
