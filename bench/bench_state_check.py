"""What the state check (``check_states``, datagen/extraction/integrity.py) costs per sample.

    .venv/bin/python bench/bench_state_check.py                      # ~1 min on 2 cores
    .venv/bin/python bench/bench_state_check.py --shapes kimi --positions 32 --device cuda

Per sample the check multiplies the checked positions' final states [k, H] by ``lm_head``
[V, H] in float32 and takes a log-softmax: k·V·H·2 FLOPs, nothing else (no forward pass).
Random weights of each shape (tiny: the tests' models; llama8b: V 128256, H 4096; kimi:
Kimi-K2.5's V 163840, H 7168); the states are bf16 as the files hold them. Each row: the
median seconds of ``StateCheck.measure`` over ``--repeats`` samples at k positions (k =
``check_positions_cpu`` on a CPU; on a GPU every output position, so ``--positions`` gives
the output lengths to time), the lm_head's float32 size and the rate in positions/s.
Writes bench/results/state_check.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from datagen.extraction.integrity import StateCheck  # noqa: E402

SHAPES = {"tiny": (512, 128), "llama8b": (128256, 4096), "kimi": (163840, 7168)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="tiny,llama8b", help=f"of {list(SHAPES)}")
    p.add_argument("--positions", default="8,32", help="positions checked per sample")
    p.add_argument("--repeats", type=int, default=5, help="samples timed per row")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "state_check.json"))
    return p.parse_args()


def sample_of(positions: int, vocab: int, seed: int) -> SimpleNamespace:
    """A captured sample with one prompt id and ``positions`` output ids, all checked."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (positions + 1,), generator=g).tolist()
    return SimpleNamespace(id=f"s{seed}", dataset="d", input_ids=ids[:-1], n_prompt=1,
                           uncaptured=(ids[-1],), logprobs=tuple([-1.0] * positions),
                           prompt_logprobs=())


def row(shape: str, positions: int, args: argparse.Namespace) -> dict[str, Any]:
    vocab, hidden = SHAPES[shape]
    device = torch.device(args.device)
    weight = torch.randn(vocab, hidden, dtype=torch.bfloat16) * 0.02
    check = StateCheck(weight, device, 0.01, 0)  # every position given: timed as asked
    _ = check.weight  # loaded (and cast to float32 on the device) before the clock starts
    times = []
    for seed in range(args.repeats + 1):
        sample = sample_of(positions, vocab, seed)
        final = torch.randn(positions, hidden, dtype=torch.bfloat16)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = check.measure(sample, final)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if seed:  # the first warms up
            times.append(time.perf_counter() - t0)
        assert result.positions == positions
    median = statistics.median(times)
    return {"shape": shape, "vocab": vocab, "hidden": hidden, "positions": positions,
            "device": args.device, "median_s": round(median, 5),
            "positions_per_s": round(positions / median, 1),
            "gflop": round(2 * positions * vocab * hidden / 1e9, 3),
            "lm_head_f32_mb": round(vocab * hidden * 4 / 2**20)}


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [row(shape, int(k), args) for shape in args.shapes.split(",")
            for k in args.positions.split(",")]
    print("| shape (V x H) | device | positions | seconds/sample | positions/s | GFLOP | "
          "lm_head f32 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} ({r['vocab']} x {r['hidden']}) | {r['device']} | "
              f"{r['positions']} | {r['median_s']:.4f} | {r['positions_per_s']:,.0f} | "
              f"{r['gflop']} | {r['lm_head_f32_mb']:,} MB |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "host": platform.node(),
                               "cpus": torch.get_num_threads(), "torch": torch.__version__,
                               "time": time.time()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
