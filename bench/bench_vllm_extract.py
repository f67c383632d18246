"""Extraction tokens/s: the `vllm` backend against `hf` on the same samples, side by side.

    .venv/bin/python bench/bench_vllm_extract.py                      # CPU, .venv-vllm's vLLM
    .venv/bin/python bench/bench_vllm_extract.py --hidden 4096 --layers 32 --heads 32 \\
        --kv-heads 8 --vocab 128256 --n-samples 64 --min-len 2048 --max-len 4096   # a GPU node

One random Llama (saved once, loaded by both), one shard of samples; each round runs the
shard through the `hf` Extractor, then through the `vllm` one (its engine started once,
before the rounds: its start-up is reported apart), each into an empty folder, so the two
figures of a round are taken on the same machine state. The files are the real ones (the
`vllm` engine writes them through the project's connector). Prints a table and writes
``--out`` (default bench/results/vllm_extract.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8, help="head size = hidden / heads (>= 32 "
                   "for vLLM's CPU attention)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--n-samples", type=int, default=48)
    p.add_argument("--min-len", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--vllm-args", default="--enforce-eager")
    p.add_argument("--inflight", type=int, default=32)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "vllm_extract.json"))
    return p.parse_args(argv)


def write_shard(path: Path, args: argparse.Namespace) -> int:
    rng = random.Random(0)
    tokens, lines = 0, []
    for i in range(args.n_samples):
        n = rng.randint(args.min_len, args.max_len)
        ids = [rng.randrange(args.vocab) for _ in range(n)]
        cut = max(1, n // 4)
        lines.append(json.dumps({"idx": i, "id": f"s{i}", "dataset": "bench",
                                 "prompt_ids": ids[:cut], "output_ids": ids[cut:]}))
        tokens += n
    path.write_text("\n".join(lines) + "\n")
    return tokens


def timed_run(ex, shard: Path, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    ex.cfg = dataclasses.replace(ex.cfg, output_dir=str(out))  # same model, an empty folder
    t0 = time.perf_counter()
    result = ex.run_shard(shard)
    seconds = time.perf_counter() - t0
    assert result.written > 0 and not result.failures, result
    return seconds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from datagen.builders.tiny_model import build_tiny_llama
    from datagen.extraction.backends.vllm import EngineOptions
    from datagen.extraction.extractor import ExtractionConfig, Extractor

    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    try:
        model = build_tiny_llama(work / "model", args.vocab, hidden_size=args.hidden,
                                 num_layers=args.layers, heads=args.heads)
        shard = work / "shard.jsonl"
        tokens = write_shard(shard, args)
        common = dict(model_path=str(model), dtype=args.dtype, device="auto",
                      max_length=args.max_len + 1, batch_tokens=max(8192, args.max_len + 1))
        hf = Extractor(ExtractionConfig(output_dir=str(work / "hf"), **common))
        t0 = time.perf_counter()
        vllm = Extractor(ExtractionConfig(
            output_dir=str(work / "vllm"), backend="vllm", **common,
            engine=EngineOptions(python=args.vllm_python, args=args.vllm_args,
                                 inflight=args.inflight)))
        start_s = time.perf_counter() - t0
        rounds = []
        for k in range(args.rounds):
            hf_s = timed_run(hf, shard, work / "hf" / f"round-{k}")
            # under the folder the engine was started with: its connector writes only there
            vllm_s = timed_run(vllm, shard, work / "vllm" / f"round-{k}")
            rounds.append({"hf_s": round(hf_s, 3), "vllm_s": round(vllm_s, 3),
                           "hf_tokens_per_s": round(tokens / hf_s),
                           "vllm_tokens_per_s": round(tokens / vllm_s),
                           "vllm_over_hf": round(hf_s / vllm_s, 3)})
        hf.close()
        vllm.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"conditions": {k: v for k, v in vars(args).items() if k != "out"}
              | {"tokens": tokens, "cpus": os.cpu_count(), "machine": platform.machine(),
                 "load_avg_1m_at_end": round(os.getloadavg()[0], 2)},
              "vllm_engine_start_s": round(start_s, 1), "rounds": rounds,
              "median_vllm_over_hf": statistics.median(r["vllm_over_hf"] for r in rounds)}
    print(f"{args.n_samples} samples, {tokens:,} tokens, Llama H={args.hidden} "
          f"L={args.layers} {args.dtype}; vLLM engine start {start_s:.0f}s (not counted)")
    print(f"{'round':>5} {'hf tokens/s':>12} {'vllm tokens/s':>14} {'vllm / hf':>10}")
    for k, r in enumerate(rounds):
        print(f"{k:>5} {r['hf_tokens_per_s']:>12,} {r['vllm_tokens_per_s']:>14,} "
              f"{r['vllm_over_hf']:>10.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
