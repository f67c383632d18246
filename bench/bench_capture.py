"""capture_states on against off on a real vLLM server: tokens/s, KV capacity, the run end to end.

    nice -n 5 .venv/bin/python bench/bench_capture.py   # ~15 min on 2 shared cores: 3 engine starts
    nice -n 5 .venv/bin/python bench/bench_capture.py --server-rounds 2 --blocks 3 \\
        --out bench/results/capture_2rounds.json                        # off, on, off, on

One tiny random Llama (built here, nothing downloaded), vLLM 0.32 from .venv-vllm. "Off" is
a generation server launched without the capture arguments (no `extract_hidden_states`
method, no connector, prefix caching at vLLM's default): what a run without capture_states
uses. "On" is the same command plus datagen.servers.capture.server_args. Only one vLLM
engine runs at a time on this host, so the two servers take turns (--server-rounds pairs,
off then on) with the same KV-cache memory (VLLM_CPU_KVCACHE_SPACE), and on each server:

  generation  --blocks blocks of --prompts requests (--concurrency threads, as a `short`
              worker sends them: /inference/v1/generate through SGLangClient, greedy,
              ignore_eos, --output-len tokens, --temperature); block k uses prompt set k on every
              server (random ids: no prefix-cache hit across blocks). On the capture server
              each block runs twice, alternately: "capture" (kv_transfer_params naming the
              file; the thread waits for it and checks it, as runner.await_states does) and
              "none" (no kv_transfer_params: what the method and connector cost a request
              that writes nothing). A short warm-up precedes the blocks, not counted.
  capacity    vLLM's start-up line "KV cache size: N tokens, Maximum concurrency for M
              tokens per request: X", against the arithmetic (K and V of every layer; plus
              one row of 4 states x H per token with capture).
  end to end  on the last server of each kind, one more block over the same --e2e-prompts
              prompts; its records are written as a worker writes them, then `datagen
              prepare`'s work (training_set.prepare) and the `gpu` worker's (the Extractor
              from runner.extraction_config, shard by shard): the `captured` backend after
              capture; the `vllm` and `hf` backends after generation without it. Wall time
              of each phase and bytes each folder holds.

Then `datagen estimate` for the seed's run (137.5M tokens, --preset kimi-k2.5) without and
with --capture, and the arithmetic of what capture does to the KV cache of an 8 x H200 node
serving INT4 Kimi-K2.5. Prints the tables and writes --out (bench/results/capture.json).
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script as well as with -m
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench import capture_parts as parts  # noqa: E402
from bench.capture_kimi import kimi_node  # noqa: E402
from datagen.servers import capture  # noqa: E402

SEED_RUN_TOKENS = 137_500_000  # the seed run: 8 x 10M + 45M + 12.5M (test_estimate.py)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4, help="head size = hidden / heads (>= 32 "
                   "for vLLM's CPU attention); kv heads = heads / 2")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="float32", help="servers, states, extraction alike "
                   "(bf16 is slow on this CPU)")
    p.add_argument("--server-rounds", type=int, default=1, help="(off, on) server pairs")
    p.add_argument("--blocks", type=int, default=3, help="measured blocks per server")
    p.add_argument("--prompts", type=int, default=48, help="requests per block")
    p.add_argument("--e2e-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="1: a random model's "
                   "tokens rarely repeat, as a real model's (the capture method's draft is "
                   "the last token: accepted when repeated); 0: greedy, outputs equal on both")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE of each server")
    p.add_argument("--shard-samples", type=int, default=32)
    p.add_argument("--no-hf", action="store_true", help="skip the `hf` extraction")
    p.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--estimate-tokens-per-s", type=float, default=30000.0,
                   help="the rate handed to `datagen estimate` without capture (an input, "
                        "not measured here: issue 5's H200 goal)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "capture.json"))
    return p.parse_args(argv)


def prompt_set(args: argparse.Namespace, seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, args.vocab) for _ in range(rng.randint(args.min_prompt,
                                                                      args.max_prompt))]
            for _ in range(n)]


def generation(args: argparse.Namespace, model: Path, work: Path, aux: tuple[int, ...]
               ) -> tuple[list[dict], list[dict], dict[str, parts.Block]]:
    """Servers off and on in turn: their start-up and capacity, the measured blocks, and the
    end-to-end block of the last server of each kind."""
    sets = [prompt_set(args, k, args.prompts) for k in range(args.blocks)]
    e2e_prompts = prompt_set(args, 1000, args.e2e_prompts)
    order = ["off", "on"] * args.server_rounds
    servers, rows, e2e = [], [], {}
    cap_dir = work / "cap"
    for i, kind in enumerate(order):
        extra = capture.server_args(str(model), cap_dir, args.dtype, aux) if kind == "on" else []
        server = parts.start_server(args.vllm_python, model, work / "logs" / f"{i}-{kind}.log",
                                    args.max_model_len, args.dtype, extra, args.kv_cache_gib)
        try:
            servers.append({"index": i, "kind": kind, "start_s": round(server.start_s, 1),
                            **parts.kv_capacity(server.log)})
            print(f"server {i} ({kind}) ready in {server.start_s:.0f} s: "
                  f"{servers[-1]['line']}", flush=True)
            parts.run_block(server.url, prompt_set(args, 999, 8), 16, 8, "warmup",
                            cap_dir if kind == "on" else None, args.temperature)
            for k in range(args.blocks):
                modes = ["off"] if kind == "off" else (
                    ["capture", "none"] if (k + i // 2) % 2 == 0 else ["none", "capture"])
                for mode in modes:
                    cpu_s = parts.server_cpu_s(server)
                    block = parts.run_block(server.url, sets[k], args.output_len,
                                            args.concurrency, "bench",
                                            cap_dir if mode == "capture" else None,
                                            args.temperature)
                    cpu_s = parts.server_cpu_s(server) - cpu_s
                    rows.append({"server": i, "round": i // 2, "mode": mode, "block": k,
                                 **block.summary(), "server_cpu_s": round(cpu_s, 2),
                                 "server_cpu_ms_per_token":
                                     round(1000 * cpu_s / block.output_tokens, 3)})
                    print(f"  block {k} {mode:<7} {block.tokens_per_s:8,.0f} output tokens/s, "
                          f"server CPU {rows[-1]['server_cpu_ms_per_token']:.2f} ms/token",
                          flush=True)
            shutil.rmtree(cap_dir / capture.STATES_DIR, ignore_errors=True)
            if i >= len(order) - 2:  # the last server of its kind
                e2e[kind] = parts.run_block(server.url, e2e_prompts, args.output_len,
                                            args.concurrency, "e2e",
                                            cap_dir if kind == "on" else None,
                                            args.temperature)
        finally:
            server.stop()
            if len(servers) > i:
                servers[i]["acceptance_lengths"] = parts.acceptance_lengths(server.log)
    return servers, rows, e2e


def ratios(rows: list[dict]) -> dict[str, Any]:
    """Per (round, block), of output tokens/s and of the server's CPU per output token:
    capture over off (the server without the connector), capture over none (the same
    capture server, requests naming no file), none over off."""
    pairs = sorted({(r["round"], r["block"]) for r in rows})
    out: dict[str, Any] = {}
    for key, name in (("output_tokens_per_s", ""), ("server_cpu_ms_per_token", "cpu_")):
        value = {(r["round"], r["block"], r["mode"]): r[key] for r in rows}
        for top, bottom in (("capture", "off"), ("capture", "none"), ("none", "off")):
            each = [round(value[p + (top,)] / value[p + (bottom,)], 3) for p in pairs]
            out[f"{name}{top}_over_{bottom}"] = each
            out[f"median_{name}{top}_over_{bottom}"] = statistics.median(each)
    return out


def run_settings(args: argparse.Namespace, model: Path, folder: Path, backend: str,
                 aux: tuple[int, ...], **more: Any) -> Any:
    from config.settings import load_settings

    return load_settings(env={}, overrides=dict(
        output_dir=str(folder), model_path=str(model), extract_backend=backend,
        extract_dtype=args.dtype, extract_device="cpu", aux_layer_ids=list(aux),
        train_max_length=args.max_model_len, shard_samples=args.shard_samples,
        keep_truncated=True,  # ignore_eos: every answer ends at its length
        vllm_python=args.vllm_python, vllm_args="--enforce-eager",
        vllm_inflight=args.concurrency, **more))


def end_to_end(args: argparse.Namespace, model: Path, work: Path, aux: tuple[int, ...],
               e2e: dict[str, parts.Block]) -> dict[str, Any]:
    cap_dir, plain_dir = work / "cap", work / "plain"
    out: dict[str, Any] = {}
    for kind, folder in (("on", cap_dir), ("off", plain_dir)):
        parts.write_records(folder, e2e[kind].records)
    cap = run_settings(args, model, cap_dir, "captured", aux)
    prep_s, shards = parts.prepare(cap)
    out["capture"] = {"generate_s": round(e2e["on"].seconds, 2), "prepare_s": round(prep_s, 2),
                      "extract": parts.extract(cap, shards),
                      "bytes": folder_sizes(cap_dir)}
    plain = run_settings(args, model, plain_dir, "vllm", aux)
    prep_s, shards = parts.prepare(plain)
    out["no_capture"] = {"generate_s": round(e2e["off"].seconds, 2),
                         "prepare_s": round(prep_s, 2), "extract": parts.extract(plain, shards)}
    if not args.no_hf:
        hf = dataclasses.replace(plain, extract_backend="hf",
                                 extraction_dir=str(plain_dir / "hidden_states_hf"))
        out["no_capture"]["extract_hf"] = parts.extract(hf, shards)
        shutil.rmtree(plain_dir / "hidden_states_hf")
    out["no_capture"]["bytes"] = folder_sizes(plain_dir)
    out["tokens"] = {"prompt": e2e["on"].prompt_tokens, "output": e2e["on"].output_tokens,
                     "same_outputs": [r["output_ids"] for r in e2e["on"].records]
                     == [r["output_ids"] for r in e2e["off"].records]}
    return out


def folder_sizes(folder: Path) -> dict[str, int]:
    training = folder / "training"
    hidden = training / "hidden_states"
    return {"states": parts.folder_bytes(folder / capture.STATES_DIR),
            "records": parts.folder_bytes(folder / "records"),
            "training_shards": parts.folder_bytes(training) - parts.folder_bytes(hidden),
            "hidden_states": parts.folder_bytes(hidden)}


def datagen_estimate(args: argparse.Namespace) -> dict[str, str]:
    """`datagen estimate` for the seed's run, as an operator types it, without and with
    --capture."""
    base = [sys.executable, "-m", "cli.main", "estimate", "--preset", "kimi-k2.5",
            "--tokens", str(SEED_RUN_TOKENS)]
    runs = {"without": [*base, "--tokens-per-s", f"{args.estimate_tokens_per_s:.0f}"],
            "with": [*base, "--capture"]}
    env = {k: v for k, v in os.environ.items() if not k.startswith("DATAGEN_")}
    return {name: subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                 check=True).stdout for name, cmd in runs.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from datagen.builders.tiny_model import build_tiny_llama
    from datagen.extraction.estimate import default_aux_layer_ids

    aux = default_aux_layer_ids(args.layers)
    work = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    started = time.monotonic()
    try:
        model = build_tiny_llama(work / "model", args.vocab, hidden_size=args.hidden,
                                 num_layers=args.layers, heads=args.heads)
        servers, rows, e2e = generation(args, model, work, aux)
        result = {"servers": servers, "blocks": rows, "ratios": ratios(rows),
                  "capacity": capacity(servers, parts.bytes_per_token(model, args.dtype, aux)),
                  "end_to_end": end_to_end(args, model, work, aux, e2e)}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["estimate"] = datagen_estimate(args)
    result["kimi_node"] = kimi_node()
    result["conditions"] = {k: v for k, v in vars(args).items() if k != "out"} | {
        "aux_layer_ids": list(aux), "cpus": os.cpu_count(), "machine": platform.machine(),
        "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        "bench_wall_s": round(time.monotonic() - started),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}
    from bench.capture_report import report

    print(report(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {args.out}")
    return 0


def capacity(servers: list[dict], per_token: dict[str, int]) -> dict[str, Any]:
    """Tokens each kind of server holds in the same memory, measured and by arithmetic."""
    tokens = {kind: statistics.median(s["kv_tokens"] for s in servers if s["kind"] == kind)
              for kind in ("off", "on")}
    attention, states = per_token["attention"], per_token["states"]
    return {"kv_tokens": tokens, "measured_on_over_off": round(tokens["on"] / tokens["off"], 4),
            "bytes_per_token": per_token,
            "arithmetic_on_over_off": round(attention / (attention + states), 4)}


if __name__ == "__main__":
    raise SystemExit(main())
