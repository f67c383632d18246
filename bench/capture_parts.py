"""Parts of bench/bench_capture.py: a vLLM generation server with capture on or off, a block
of generate requests sent as a `short` worker sends them, the KV-cache capacity vLLM logs at
start-up, and the end-to-end phases after generation (records, prepare, extraction)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from datagen.client import SGLangClient, new_rid
from datagen.servers import capture
from datagen.servers.launch import engine_env, stop_group

# vLLM 0.32, v1/core/kv_cache_utils.py update_kv_cache_capacity (its "GPU" is "CPU" here)
KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) "
                     r"tokens per request: ([\d.]+)x")
# vLLM 0.32, v1/spec_decode/metrics.py: the capture method runs as a speculative one whose
# draft is the token just sampled, so a step verifies 2 positions a request and keeps the draft
# when the model repeats its last token (often, for a random model decoding greedily)
ACCEPTANCE_LINE = re.compile(r"SpecDecoding metrics: Mean acceptance length: ([\d.]+)")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class Server:
    """vLLM's OpenAI server under the project's launcher (one process group, ended with us)."""

    url: str
    proc: subprocess.Popen
    log: Path
    start_s: float

    def stop(self) -> None:
        stop_group(self.proc)


def start_server(python: str, model: Path, log: Path, max_model_len: int, dtype: str,
                 extra_args: Sequence[str], kv_cache_gib: str, timeout_s: float = 900.0
                 ) -> Server:
    """The generation server DESIGN.md describes (token API, no tokenizer), plus
    ``extra_args`` (capture.server_args for capture on); ready when /health answers."""
    from cli.vllm import launch_argv, launcher_argv

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = launch_argv(model, port, max_model_len, dtype,
                       ["--served-model-name", "tiny", *extra_args], python)
    # the same KV-cache memory for both servers, so their token capacities compare
    env = dict(engine_env(), VLLM_CPU_KVCACHE_SPACE=kv_cache_gib)
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "ab") as fh:
        proc = subprocess.Popen(launcher_argv(argv), stdout=fh, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc, log, 0.0)
    try:
        while not _healthy(server):
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {proc.returncode}: "
                                   f"{log.read_text(errors='replace')[-3000:]}")
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"vLLM not ready after {timeout_s:.0f} s (log {log})")
            time.sleep(0.5)
    except BaseException:
        server.stop()
        raise
    server.start_s = time.monotonic() - started
    return server


def server_cpu_s(server: Server) -> float:
    """CPU seconds the server's processes (API server, engine core, its threads) used so far:
    on a host shared with other work, a steadier cost than wall time."""
    import psutil

    root = psutil.Process(server.proc.pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _healthy(server: Server) -> bool:
    try:
        return requests.get(f"{server.url}/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


def kv_capacity(log: Path) -> dict[str, Any]:
    """What vLLM logged of its KV cache at start-up: tokens it holds, and requests of
    max_model_len tokens that fit at once."""
    found = KV_LINE.search(log.read_text(errors="replace"))
    if not found:
        raise ValueError(f"no 'KV cache size' line in {log}")
    return {"kv_tokens": int(found[1].replace(",", "")),
            "max_model_len": int(found[2].replace(",", "")),
            "max_concurrency": float(found[3]), "line": found[0]}


def acceptance_lengths(log: Path) -> list[float]:
    """Every "Mean acceptance length" a capture server logged (none without capture)."""
    return [float(m) for m in ACCEPTANCE_LINE.findall(log.read_text(errors="replace"))]


def bytes_per_token(model: Path, dtype: str, aux_ids: Sequence[int]) -> dict[str, int]:
    """The arithmetic the capacity figures are checked against: attention K and V of every
    layer, and the hidden-state cache vLLM adds with capture (one [ids, H] row per token)."""
    cfg = json.loads((model / "config.json").read_text())
    b, layers, hidden = DTYPE_BYTES[dtype], cfg["num_hidden_layers"], cfg["hidden_size"]
    head = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    ids, _ = capture.vllm_capture(aux_ids, layers)
    return {"attention": 2 * layers * cfg["num_key_value_heads"] * head * b,
            "states": len(ids) * hidden * b, "capture_ids": len(ids)}


@dataclass
class Block:
    seconds: float
    requests: int
    prompt_tokens: int
    output_tokens: int
    states_bytes: int
    records: list[dict[str, Any]]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def summary(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 3), "requests": self.requests,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "output_tokens_per_s": round(self.tokens_per_s, 1),
                "states_bytes": self.states_bytes}


def run_block(url: str, prompts: Sequence[list[int]], output_len: int, concurrency: int,
              dataset: str, states_under: Path | None = None, temperature: float = 0.0
              ) -> Block:
    """Every prompt through ``concurrency`` threads, as a `short` worker's threads send them
    (/inference/v1/generate through SGLangClient); with ``states_under`` (the capture
    server's output_dir) each request names its file, and its thread waits for it and checks
    it before taking the next prompt, as runner.await_states does."""
    client = SGLangClient(url, kind="vllm", read_timeout_s=1800.0)
    params = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": temperature}

    def one(item: tuple[int, list[int]]) -> dict[str, Any]:
        number, prompt = item
        rid = new_rid(dataset)
        path = capture.states_path(states_under, dataset, rid) if states_under else None
        extra = {"kv_transfer_params": capture.request_params(path)} if path else None
        gen = client.generate(prompt, params, rid, extra=extra)
        record = {"v": 1, "id": f"p{number}", "dataset": dataset, "rid": rid, "queue": "short",
                  "prompt_ids": prompt, "output_ids": gen.output_ids,
                  "finish_reason": gen.finish_reason, "prompt_tokens": gen.prompt_tokens,
                  "completion_tokens": gen.completion_tokens, "truncated": gen.truncated,
                  "server": url, "time": time.time(), "latency_s": gen.latency_s}
        if path is not None:
            if not capture.wait_released(path, 600):
                raise TimeoutError(f"{path.name} still locked 600 s after the answer")
            record["states_bytes"] = capture.check_file(path, prompt + gen.output_ids[:-1])
            Path(f"{path}.lock").unlink(missing_ok=True)
            record["states"] = str(path.relative_to(states_under.resolve()))
        return record

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        records = list(pool.map(one, enumerate(prompts)))
    seconds = time.perf_counter() - started
    return Block(seconds, len(records), sum(len(p) for p in prompts),
                 sum(r["completion_tokens"] for r in records),
                 sum(r.get("states_bytes", 0) for r in records), records)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def write_records(output_dir: Path, records: Sequence[dict[str, Any]]) -> None:
    """The records a worker would have stored (RecordWriter, the runner's fields)."""
    from datagen.generation.records import RecordWriter

    writer = RecordWriter(output_dir, "bench")
    for record in records:
        writer.append(record)
    writer.close()


def prepare(settings: Any) -> tuple[float, list[Path]]:
    """`datagen prepare`'s work (training_set.prepare) on the records on disk, every record
    counted as committed (no ledger here): seconds, and the shards it wrote."""
    from datagen.training import training_set

    started = time.perf_counter()
    tset = training_set.prepare(settings, {}, None)
    seconds = time.perf_counter() - started
    return seconds, [Path(settings.output_dir) / s["path"] for s in tset.shards]


def extract(settings: Any, shards: Sequence[Path]) -> dict[str, Any]:
    """What a `gpu` worker does with each shard: the Extractor built from the settings
    (runner.extraction_config), its backend started once (timed apart: an engine start
    is paid once per worker, not per shard), then every shard."""
    from datagen.extraction.extractor import Extractor
    from datagen.extraction.runner import extraction_config

    started = time.perf_counter()
    extractor = Extractor(extraction_config(settings))
    start_s = time.perf_counter() - started
    written = tokens = 0
    try:
        started = time.perf_counter()
        for shard in shards:
            result = extractor.run_shard(shard)
            assert result.written and not result.failures, result
            written, tokens = written + result.written, tokens + result.tokens
        run_s = time.perf_counter() - started
    finally:
        extractor.close()
    return {"backend": settings.extract_backend, "start_s": round(start_s, 2),
            "run_s": round(run_s, 2), "samples": written, "tokens": tokens,
            "tokens_per_s": round(tokens / run_s)}
