"""Peak disk of the `captured` build: the captured files kept beside the rows (two copies) or
freed once each row is durable (``keep_captured_states`` off: one copy plus what is in flight).

    .venv/bin/python bench/bench_capture_disk.py                # ~1 min on 2 cores
    .venv/bin/python bench/bench_capture_disk.py --samples 400 --positions 2048

Writes ``--samples`` captured files as the server's connector lays them out (safetensors:
input_ids, aux_hidden_state [L, 3H], hidden_state [L, H], bf16) under a run folder, then
builds them with the `captured` backend twice, keep on and keep off, each into its own
extraction folder. A thread walks both folders every ``--poll-ms`` and keeps the largest sum
of allocated bytes (st_blocks); the state check is off (no lm_head: random states). Writes
bench/results/capture_disk.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from datagen.extraction.extractor import ExtractionConfig, Extractor  # noqa: E402

AUX = [1, 3, 4]  # SpecForge's default for 8 layers


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--positions", type=int, default=1024, help="states per sample")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--threads", type=int, default=4, help="extract_writer_threads")
    p.add_argument("--poll-ms", type=float, default=2.0)
    p.add_argument("--dir", default="", help="where to write (default: a temp folder)")
    p.add_argument("--out", default=str(REPO / "bench/results/capture_disk.json"))
    return p.parse_args()


def allocated(*folders: Path) -> int:
    total = 0
    for folder in folders:
        for root, _, names in os.walk(folder):
            for name in names:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except FileNotFoundError:
                    continue
    return total


class PeakDisk:
    """The most bytes allocated under ``folders`` seen by a polling thread."""

    def __init__(self, folders: list[Path], poll_s: float):
        self.folders, self.poll_s, self.peak = folders, poll_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, allocated(*self.folders))
            time.sleep(self.poll_s)

    def __enter__(self) -> PeakDisk:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, allocated(*self.folders))


def write_run(run: Path, model: Path, args: argparse.Namespace) -> Path:
    """The captured files and the shard naming them; returns the shard."""
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(
        {"hidden_size": args.hidden, "num_hidden_layers": 8, "vocab_size": 1000}))
    g = torch.Generator().manual_seed(0)
    n_prompt, lines = args.positions // 4, []
    for idx in range(args.samples):
        ids = torch.randint(0, 1000, (args.positions,), generator=g)
        rel = f"states/B1/r{idx}.safetensors"
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        save_file({"input_ids": ids,
                   "aux_hidden_state": torch.randn(args.positions, 3 * args.hidden,
                                                   generator=g).to(torch.bfloat16),
                   "hidden_state": torch.randn(args.positions, args.hidden,
                                               generator=g).to(torch.bfloat16)},
                  str(run / rel), {"aux_layer_ids": json.dumps(AUX)})
        out = ids[n_prompt:].tolist() + [999]  # the last output id is never captured
        lines.append(json.dumps({"idx": idx, "id": f"s{idx}", "dataset": "B1",
                                 "prompt_ids": ids[:n_prompt].tolist(), "output_ids": out,
                                 "states": rel}))
    shard = run / "shard.jsonl"
    shard.write_text("\n".join(lines) + "\n")
    return shard


def build(root: Path, keep: bool, args: argparse.Namespace) -> dict[str, Any]:
    run, model, hs = root / "run", root / "model", root / "hs"
    for folder in (run, hs):
        shutil.rmtree(folder, ignore_errors=True)
    shard = write_run(run, model, args)
    states = allocated(run / "states")
    cfg = ExtractionConfig(model_path=str(model), output_dir=str(hs), dtype="bfloat16",
                           device="cpu", max_length=args.positions, backend="captured",
                           run_dir=str(run), check_states=False, check_free_space=False,
                           writer_threads=args.threads, keep_captured_states=keep)
    with Extractor(cfg) as ex, PeakDisk([run / "states", hs], args.poll_ms / 1000) as peak:
        t0 = time.perf_counter()
        result = ex.run_shard(shard)
        seconds = time.perf_counter() - t0
    assert result.written == args.samples and not result.failures, result
    rows = allocated(hs)
    return {"keep_captured_states": keep, "states_bytes": states, "rows_bytes": rows,
            "left_bytes": allocated(run / "states", hs), "peak_bytes": peak.peak,
            "peak_over_rows": round(peak.peak / rows, 4), "seconds": round(seconds, 2),
            "tokens_per_s": round(result.tokens / seconds)}


def main() -> None:
    args = parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="capture_disk_"))
    runs = [build(root, keep, args) for keep in (True, False)]
    shutil.rmtree(root, ignore_errors=True)
    print(f"{args.samples} samples x {args.positions} positions, H {args.hidden}, bf16, "
          f"{args.threads} writer threads")
    print("| keep_captured_states | states MB | rows MB | peak MB | peak / rows | left after MB "
          "| build s |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {str(r['keep_captured_states']).lower()} | {r['states_bytes'] / 1e6:,.1f} | "
              f"{r['rows_bytes'] / 1e6:,.1f} | {r['peak_bytes'] / 1e6:,.1f} | "
              f"{r['peak_over_rows']:.3f} | {r['left_bytes'] / 1e6:,.1f} | {r['seconds']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "host": platform.node(),
                                          "cpus": os.cpu_count(), "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
