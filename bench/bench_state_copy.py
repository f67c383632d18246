"""Peak memory of the capture connector's copy path against the length of the requests that
end in one engine step: the whole-request path it had before, and the bounded one
(datagen/extraction/state_copy.py) it has now.

    .venv/bin/python bench/bench_state_copy.py     # Kimi-K2.5's state width, ~1 min on 2 cores
    .venv/bin/python bench/bench_state_copy.py --hidden 64 --cases 2x64 --chunk-tokens 32

Each case (``COUNTxLENGTH``: COUNT requests of LENGTH positions ending in the same step) and
each path runs in a child process of its own, on a cache laid out as vLLM's hidden-states
group ([blocks, ids, block_size, H], bfloat16; ``--ids 4 --hidden 7168``: Kimi-K2.5's aux
layers and last layer, 57,344 bytes a position), on CUDA where there is a device and on the
CPU otherwise. The child fills the cache, then reports how far the copy path raised its peak
resident memory above that (ru_maxrss) and, on CUDA, its peak GPU memory above the cache
(max_memory_allocated); the parent checks that both paths wrote the same bytes.

- before: each ending request gathered whole (vLLM's extract_from_kv_cache; on CUDA into a
  new device tensor, then into a pinned host tensor of its size), handed to 8 writer threads;
- after: ``StateCopier`` with the connector's defaults (512-position chunks, 8 host buffers,
  8 writer threads), pumped once a step until every request is on the host.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from datagen.extraction.state_copy import StateCopier, StateLayout  # noqa: E402
from datagen.extraction.state_sink import SafetensorsSink  # noqa: E402

BLOCK = 16
WRITERS = 8


def parse_case(text: str) -> tuple[int, int]:
    count, _, length = text.partition("x")
    return int(count), int(length)


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def make_cache(blocks: int, ids: int, hidden: int, device: str) -> torch.Tensor:
    cache = torch.empty(blocks, ids, BLOCK, hidden, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    for start in range(0, blocks, 64):  # in place: no float32 copy of the whole cache
        cache[start:start + 64].normal_(generator=gen)
    return cache


def layout(ids: int, hidden: int) -> StateLayout:
    slots = tuple(range(ids - 1)) + (ids - 1,)
    return StateLayout(slots, torch.ones(hidden, dtype=torch.bfloat16), 1e-6, torch.bfloat16)


def before(cache: torch.Tensor, lay: StateLayout, reqs: list[tuple[list[int], int]],
           out: Path) -> None:
    """The connector's path until now: the whole request gathered, then written."""
    from safetensors.torch import save_file

    from datagen.extraction.files import save_atomic

    pool = ThreadPoolExecutor(WRITERS)

    def write(rows: torch.Tensor, event: Any, i: int, n: int) -> None:
        if event is not None:
            event.synchronize()
        # rows [n, ids, H] seen as one block of n positions: the old path's aux and norm
        aux, final = lay.tensors(rows.unsqueeze(0).transpose(1, 2), n)
        save_atomic(out / f"r{i}.safetensors",
                    {"input_ids": torch.arange(n), "aux_hidden_state": aux,
                     "hidden_state": final},
                    save=lambda t, p: save_file(t, str(p)))

    for i, (blocks, n) in enumerate(reqs):  # all in the engine's step
        b = torch.tensor(blocks, dtype=torch.long)
        slots = (torch.arange(BLOCK)[None, :] + b[:, None] * BLOCK).flatten().to(cache.device)
        if cache.is_cuda:
            rows = cache[slots // BLOCK, :, slots % BLOCK][:n]
            host = torch.empty_like(rows, device="cpu", pin_memory=True)
            host.copy_(rows, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            del rows
        else:
            host, event = cache[slots // BLOCK, :, slots % BLOCK][:n].clone(), None
        pool.submit(write, host, event, i, n)
        del host
    pool.shutdown(wait=True)


def after(cache: torch.Tensor, lay: StateLayout, reqs: list[tuple[list[int], int]],
          out: Path, chunk_tokens: int, buffers: int) -> dict[str, Any]:
    pool = ThreadPoolExecutor(WRITERS)
    copier = StateCopier(cache, lay, pool, chunk_blocks=max(1, chunk_tokens // BLOCK),
                         host_buffers=buffers)
    failed: list[Any] = []
    widths = lay.widths(cache.shape[-1])
    for i, (blocks, n) in enumerate(reqs):
        copier.submit(f"r{i}", blocks, n, SafetensorsSink(
            out / f"r{i}.safetensors", torch.arange(n), widths, lay.dtype),
            lambda job, error: failed.append(error) if error else None)
    steps = 0
    while copier.pending():
        copier.pump()
        steps += 1
        time.sleep(0.001)  # the engine's idle step
    pool.shutdown(wait=True)
    assert not failed, failed
    return {"steps": steps, "waits": copier.waits, "pool_mb": round(
        copier.pool.count * copier.pool.buffer_bytes / 2**20, 1),
            "staging_mb": round(copier.staging_bytes / 2**20, 1)}


def child(args: argparse.Namespace) -> None:
    count, length = parse_case(args.case)
    per = -(-length // BLOCK)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cache = make_cache(count * per + 1, args.ids, args.hidden, device)
    lay = layout(args.ids, args.hidden)
    # every other block of the cache, as a busy engine scatters them
    order = list(range(0, count * per + 1, 2)) + list(range(1, count * per + 1, 2))
    reqs = [(order[i * per:(i + 1) * per], length) for i in range(count)]
    out = Path(args.out_dir)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        gpu_base = torch.cuda.memory_allocated()
    base, t0 = rss_mb(), time.perf_counter()
    extra: dict[str, Any] = {}
    if args.path == "before":
        before(cache, lay, reqs, out)
    else:
        extra = after(cache, lay, reqs, out, args.chunk_tokens, args.buffers)
    result = {"device": device, "host_peak_mb": round(max(0.0, rss_mb() - base), 1),
              "seconds": round(time.perf_counter() - t0, 2), **extra}
    if device == "cuda":
        result["gpu_peak_mb"] = round((torch.cuda.max_memory_allocated() - gpu_base) / 2**20, 1)
    print(json.dumps(result))


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.glob("*.safetensors")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="1x4096,4x4096,1x16384,2x16384",
                    help="COUNTxLENGTH,...: requests ending in one step")
    ap.add_argument("--ids", type=int, default=4, help="cached ids (aux layers + the last)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--buffers", type=int, default=8)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "state_copy.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    per_token = args.ids * args.hidden * 2
    rows, work = [], Path(tempfile.mkdtemp(prefix="bench_state_copy_"))
    try:
        for case in args.cases.split(","):
            count, length = parse_case(case)
            row: dict[str, Any] = {"case": case, "tokens": count * length,
                                   "states_mb": round(count * length * per_token / 2**20, 1)}
            digests = {}
            for path in ("before", "after"):
                folder = work / f"{case}-{path}"
                folder.mkdir()
                res = subprocess.run(
                    [sys.executable, __file__, "--child", "--path", path, "--case", case,
                     "--out-dir", str(folder), "--ids", str(args.ids), "--hidden",
                     str(args.hidden), "--chunk-tokens", str(args.chunk_tokens),
                     "--buffers", str(args.buffers)],
                    capture_output=True, text=True, check=True)
                row[path] = json.loads(res.stdout.strip().splitlines()[-1])
                digests[path] = digest(folder)
                shutil.rmtree(folder)
            row["same_bytes"] = digests["before"] == digests["after"]
            rows.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    device = rows[0]["after"]["device"]
    gpu = device == "cuda"
    print(f"per position: {per_token} bytes ({args.ids} ids x {args.hidden} x 2 B); "
          f"chunk {args.chunk_tokens} positions, {args.buffers} host buffers; {device}")
    print("| requests ending together | positions | states MB | host peak before MB | "
          "host peak after MB |" + (" GPU peak before MB | GPU peak after MB |" if gpu else "")
          + " steps held | same bytes |")
    print("|---|---:|---:|---:|---:|" + ("---:|---:|" if gpu else "") + "---:|---|")
    for r in rows:
        b, a = r["before"], r["after"]
        print(f"| {r['case']} | {r['tokens']} | {r['states_mb']} | {b['host_peak_mb']} | "
              f"{a['host_peak_mb']} |"
              + (f" {b['gpu_peak_mb']} | {a['gpu_peak_mb']} |" if gpu else "")
              + f" {a['waits']} | {r['same_bytes']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "ids": args.ids, "hidden": args.hidden, "bytes_per_position": per_token,
        "chunk_tokens": args.chunk_tokens, "host_buffers": args.buffers, "writers": WRITERS,
        "device": device, "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__, "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
