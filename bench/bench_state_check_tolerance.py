"""How far a second forward's states land from a bf16 server's log-probabilities, against how
far states one position late land: the ground for the state check's ``recompute`` tolerance
(datagen/extraction/tolerance.py).

    .venv/bin/python bench/bench_state_check_tolerance.py          # ~30 s on 2 cores

For each tiny random Llama (the tests' shapes) and random ids: the "server" is the model in
bfloat16 (its logits rounded to bf16 before the log-softmax, as a bf16 engine's), the states
are a float32 forward's final states (what the hf or vllm backend writes in float32). Per
position: the gap |ours − server's| in nats, and its ratio to (|z_id| + max |z|) in units of
bf16's base rtol (2^-7): the ``recompute`` allowance is ``RECOMPUTE`` of those units. The same
states rolled by one position give the gaps a misaligned file makes. Writes
bench/results/state_check_tolerance.json (``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from datagen.extraction.tolerance import RECOMPUTE  # noqa: E402

SHAPES = ((256, 64, 6), (512, 128, 8))  # vocab, hidden, layers


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--positions", type=int, default=300)
    p.add_argument("--out", default=str(REPO / "bench" / "results" /
                                        "state_check_tolerance.json"))
    return p.parse_args()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0]


def row(vocab: int, hidden: int, layers: int, positions: int, folder: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from datagen.builders.tiny_model import build_tiny_llama

    path = build_tiny_llama(folder / f"llama{vocab}", vocab, hidden_size=hidden,
                            num_layers=layers)
    f32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    b16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, vocab, (1, positions + 1), generator=torch.Generator().manual_seed(0))
    tokens = ids[0, 1:]
    with torch.no_grad():
        server = token_logprobs(b16(ids).logits[0, :-1], tokens)
        h = f32(ids, output_hidden_states=True).hidden_states[-1][0, :-1]
        head = f32.get_output_embeddings().weight
        z = h @ head.T
        gap = (token_logprobs(z, tokens) - server).abs()
        scale = z.gather(1, tokens[:, None])[:, 0].abs() + z.abs().amax(-1)
        shifted = (token_logprobs(torch.roll(h, 1, 0) @ head.T, tokens) - server).abs()
    units = gap / scale / 2.0 ** -7
    return {"vocab": vocab, "hidden": hidden, "layers": layers, "positions": positions,
            "gap_max": round(float(gap.max()), 5), "gap_median": round(float(gap.median()), 5),
            "rtol_units_max": round(float(units.max()), 3),
            "shifted_gap_median": round(float(shifted.median()), 4),
            "shifted_gap_max": round(float(shifted.max()), 4)}


def main() -> int:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row(*shape, args.positions, Path(tmp)) for shape in SHAPES]
    print(f"| model (V, H, layers) | positions | gap median | gap max | worst in bf16 rtol "
          f"units (allowed {RECOMPUTE:g}) | shifted by one: median | max |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['vocab']}, {r['hidden']}, {r['layers']} | {r['positions']} | "
              f"{r['gap_median']} | {r['gap_max']} | {r['rtol_units_max']} | "
              f"{r['shifted_gap_median']} | {r['shifted_gap_max']} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "torch": torch.__version__, "time": time.time()},
                              indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
