"""How far the state check (integrity.py) lets a sample's log-probabilities be from the server's.

The gap |ours − server's| at a position is allowed ``atol + rtol · (|z_t| + max_j |z_j|)``
nats, z the logits there. What sets rtol is where the two numbers come from, not the dtype
the files happen to be stored in:

- the **server's** log-probabilities were computed from logits rounded to the dtype the
  generation engine ran in (``server_dtype``; its max and log-sum-exp carry that rounding):
  twice its unit roundoff (bf16 2^-7, f16 2^-10; f32 2^-20, which leaves room for the
  order of its sums);
- our logits come from the stored states, rounded to their own dtype: the coarser of the two
  dtypes sets the base;
- **the path**. ``captured``: the states came out of the very forward that produced the
  server's logits, so the base is all. ``recompute`` (the hf, hf-tp, sglang and vllm backends
  run another forward of the same ids): that forward carries its own error through every
  layer, ``RECOMPUTE`` times the base (measured 2026-12-06: a tiny Llama's bf16
  log-probabilities against its float32 states, 300 positions, came to 1.0-1.24 times the
  base at the worst position; bench/bench_state_check_tolerance.py); on a MoE model a
  router score that rounds the other way sends a token to another expert and moves its state
  by percents (vLLM's MLA + MoE against transformers' in float32: 0.4-1.6%, 3% at most,
  tests/real_vllm/test_vllm_backend.py), so a recompute on a MoE model allows ``MOE_RTOL``
  at least.

A float32 extraction checked against a bf16 server is thus allowed the bf16 server's rounding,
not float32's (which would fail nearly every sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -21, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PATHS = ("captured", "recompute")
RECOMPUTE = 4.0   # a second forward's own error, in units of the base rtol
MOE_RTOL = 0.03   # routing flips between two forwards of a MoE model
MOE_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


def base_rtol(dtype: torch.dtype) -> float:
    """Twice the dtype's unit roundoff (an unknown dtype counts as bf16)."""
    return 2 * UNIT_ROUNDOFF.get(dtype, UNIT_ROUNDOFF[torch.bfloat16])


@dataclass(frozen=True)
class Tolerance:
    """What the check allows for one extraction: the server's dtype (None: the stored
    states' own, as when the states and the logits are one engine's output), the path and
    whether the model routes tokens through experts."""

    server_dtype: torch.dtype | None = None
    path: str = "captured"
    moe: bool = False

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"path={self.path!r}: expected one of {list(PATHS)}")

    def rtol(self, states_dtype: torch.dtype) -> float:
        """rtol for states stored as ``states_dtype``."""
        rtol = max(base_rtol(states_dtype), base_rtol(self.server_dtype or states_dtype))
        if self.path == "captured":
            return rtol
        return max(RECOMPUTE * rtol, MOE_RTOL if self.moe else 0.0)


def is_moe(config: dict[str, Any]) -> bool:
    """Whether a (text) config routes tokens through experts."""
    return any(int(config.get(key) or 0) > 0 for key in MOE_KEYS)


def server_dtype(wanted: str, config: dict[str, Any]) -> torch.dtype:
    """The generation server's dtype: ``wanted``, or with "auto" the checkpoint's own
    (config.json's ``dtype``, ``torch_dtype`` in older ones; bf16 where it names none)."""
    if wanted != "auto":
        return DTYPES[wanted]
    named = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return DTYPES.get(str(named), torch.bfloat16)


def for_extraction(backend: str, wanted_server_dtype: str, config: dict[str, Any]) -> Tolerance:
    """The tolerance of an extraction on ``backend`` (the ``captured`` one reads the
    server's own states; every other runs a forward of its own)."""
    return Tolerance(server_dtype(wanted_server_dtype, config),
                     "captured" if backend == "captured" else "recompute", is_moe(config))
