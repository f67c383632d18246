"""How much memory the state check (datagen/extraction/integrity.py) takes at its peak, with
its logits computed a chunk of positions at a time and all at once.

    .venv/bin/python bench/bench_state_check_memory.py                  # Kimi's shape, ~3 min
    .venv/bin/python bench/bench_state_check_memory.py --shape tiny --positions 64,256

Per sample the check computes the float32 logits [k, V] of its k checked positions and
reduces them (logsumexp, the target's logit, amax/amin). All at once (``chunk_positions``
0) that is k·V·4 bytes a tensor, and two such tensors live at the peak (the logits and
logsumexp's own); chunked (the default: ``CHUNK_BYTES`` of logits, 409 positions at a
163,840-token vocabulary) it is bounded whatever k is. Each row runs in a process of its
own: the float32 ``lm_head`` of the shape (random) and bf16 states of k positions are made
first, the process's peak resident memory is reset (/proc/self/clear_refs), then one
``StateCheck.measure`` over every position runs, and the row is the peak's growth over the
memory before it. Writes bench/results/state_check_memory.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_state_check import SHAPES, sample_of  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="kimi", help=f"one of {list(SHAPES)}")
    p.add_argument("--positions", default="256,1024", help="positions checked per sample")
    p.add_argument("--chunk", default="auto",
                   help="positions a chunk in the chunked rows (auto: CHUNK_BYTES of logits)")
    p.add_argument("--one", nargs=2, metavar=("POSITIONS", "CHUNK"), help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "state_check_memory.json"))
    return p.parse_args()


def status_kb(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+) kB", text).group(1))


def one(shape: str, positions: int, chunk: int | None) -> dict[str, Any]:
    """The peak growth of one measure() in this process."""
    import torch

    from datagen.extraction.integrity import StateCheck

    vocab, hidden = SHAPES[shape]
    weight = torch.randn(vocab, hidden).mul_(0.02)  # in place: one copy of 4.7 GB at Kimi's
    check = StateCheck(weight, torch.device("cpu"), 0.01, 0, chunk_positions=chunk)
    sample = sample_of(positions, vocab, 0)
    final = torch.randn(positions, hidden, dtype=torch.bfloat16)
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    before = status_kb("VmRSS")
    t0 = time.perf_counter()
    result = check.measure(sample, final)
    seconds = time.perf_counter() - t0
    assert result.positions == positions
    return {"peak_mb": round((status_kb("VmHWM") - before) / 1024, 1),
            "chunk_positions": check.chunk(vocab), "seconds": round(seconds, 2)}


def row(shape: str, positions: int, chunk: str) -> dict[str, Any]:
    """``chunk``: "0" (all at once), "auto" or a number of positions."""
    cmd = [sys.executable, __file__, "--shape", shape, "--one", str(positions), chunk]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    vocab, hidden = SHAPES[shape]
    return {"shape": shape, "vocab": vocab, "hidden": hidden, "positions": positions,
            "chunked": chunk != "0", **json.loads(done.stdout.splitlines()[-1]),
            "logits_f32_mb": round(positions * vocab * 4 / 2**20, 1)}


def main() -> int:
    args = parse_args()
    if args.one:
        positions, chunk = args.one
        print(json.dumps(one(args.shape, int(positions), None if chunk == "auto" else int(chunk))))
        return 0
    rows = [row(args.shape, int(k), chunk) for k in args.positions.split(",")
            for chunk in ("0", args.chunk)]
    print("| shape (V x H) | positions | logits | chunk (positions) | peak growth | seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        chunk = r["chunk_positions"] if r["chunked"] else "all at once"
        print(f"| {r['shape']} ({r['vocab']} x {r['hidden']}) | {r['positions']:,} | "
              f"{r['logits_f32_mb']:,.0f} MB | {chunk} | {r['peak_mb']:,.0f} MB | "
              f"{r['seconds']} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "host": platform.node(), "time": time.time()},
                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
