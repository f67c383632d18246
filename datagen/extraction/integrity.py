"""Every sample's states proved against the engine's own output (``check_states``).

The generation server answers each sampled token's log-probability (vLLM's ``raw_logprobs``:
the log-softmax of the model's logits before any sampling transform; datagen/servers/vllm.py),
and the record keeps them (``output_logprobs``). The model's log-probability of output id i is
``log_softmax(lm_head(h))`` at that id, where h is the final state of the position before it
(prompt length − 1 + i): the post-norm state every backend stores as ``hidden_state``
(SpecForge's TargetHead applies ``lm_head`` to it and nothing else). So a file whose final
states are the model's, in line with its ids, gives back the server's numbers; a file whose
states are shifted by a position, come from another layer or another request, does not.

The gap |ours − server's| is allowed ``atol + rtol · (|z_t| + max_j |z_j|)`` nats, z the
logits at the position: rtol is the dtype's unit roundoff times two (bf16 2^-7, f16 2^-10,
f32 2^-20), since the engine rounds each logit to its dtype before its log-softmax, and
its max and log-sum-exp carry that error; atol (``check_atol_nats``) covers the rest (the
connector's own final norm against the engine's). On a GPU every position is checked; on a
CPU a fixed random subset of ``check_positions_cpu`` (seeded by the sample's id). The check
only reads the final state and multiplies it by ``lm_head`` in float32: no forward pass.
"""

from __future__ import annotations

import json
import random
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")
EMBED_KEYS = ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight")
RTOL = {torch.float32: 2.0 ** -20, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
NO_LOGPROB = -9999.0  # vLLM's floor: a token it had no log-probability for


@dataclass(frozen=True)
class Checked:
    positions: int  # positions compared (0: the sample carries no log-probabilities)
    gap: float      # the worst |ours - server's| in nats
    position: int   # where (index into the sample's ids)
    excess: float   # the worst gap minus what its position allows (> 0: failed)


class StateCheckFailed(ValueError):
    """A sample's final states do not give the server's log-probabilities."""

    def __init__(self, message: str, result: Checked):
        super().__init__(message)
        self.result = result


@dataclass
class CheckTally:
    """What a shard's (or a run's) checks found, for its entry and the manifest."""

    checked: int = 0    # samples checked
    failed: int = 0
    unchecked: int = 0  # samples without log-probabilities
    positions: int = 0
    worst_gap: float = 0.0

    def add(self, result: Checked, failed: bool) -> None:
        if not result.positions:
            self.unchecked += 1
            return
        self.checked += 1
        self.failed += failed
        self.positions += result.positions
        self.worst_gap = max(self.worst_gap, result.gap)

    def as_dict(self) -> dict[str, Any]:
        return {"checked": self.checked, "failed": self.failed, "unchecked": self.unchecked,
                "positions": self.positions, "worst_gap": round(self.worst_gap, 6)}


def checkpoint_tensor(model_path: str, keys: tuple[str, ...]) -> torch.Tensor | None:
    """The first of ``keys`` in the checkpoint's safetensors (sharded or not), or None."""
    from safetensors import safe_open

    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        where = [(key, weight_map[key]) for key in keys if key in weight_map]
    else:
        where = [(key, name.name) for key in keys for name in sorted(folder.glob("*.safetensors"))]
    for key, name in where:
        with safe_open(str(folder / name), framework="pt") as fh:
            if key in fh.keys():
                return fh.get_tensor(key)
    return None


def lm_head_weight(model_path: str) -> torch.Tensor:
    """[V, H]: ``lm_head`` (a text model's or a multimodal one's), else the tied embedding."""
    weight = checkpoint_tensor(model_path, LM_HEAD_KEYS)
    if weight is None:
        weight = checkpoint_tensor(model_path, EMBED_KEYS)
    if weight is None:
        raise KeyError(f"{model_path}: none of {list(LM_HEAD_KEYS + EMBED_KEYS)} in the "
                       "checkpoint")
    return weight


class StateCheck:
    """Checks a sample's final states [n, H] against its log-probabilities."""

    def __init__(self, weight: torch.Tensor | Callable[[], torch.Tensor],
                 device: torch.device, atol_nats: float, positions_cpu: int):
        """``weight``: lm_head [V, H], or what loads it (on the first sample that has
        log-probabilities: a run without them never reads it)."""
        self.device = device
        self._weight = weight
        self._lock = threading.Lock()
        self.atol = atol_nats
        self.limit = 0 if device.type == "cuda" else positions_cpu  # 0: every position

    @classmethod
    def for_model(cls, model_path: str, device: torch.device, atol_nats: float,
                  positions_cpu: int) -> StateCheck:
        return cls(lambda: lm_head_weight(model_path), device, atol_nats, positions_cpu)

    @property
    def weight(self) -> torch.Tensor:
        """float32 on the check's device (the engine's logits are float32 from here on)."""
        with self._lock:
            if callable(self._weight):
                self._weight = self._weight()
            if self._weight.device != self.device or self._weight.dtype != torch.float32:
                self._weight = self._weight.to(device=self.device, dtype=torch.float32)
            return self._weight

    def rows(self, sample: Any, n: int) -> list[tuple[int, int, float]]:
        """(position, token, server logprob) of the checked positions, position < n."""
        # the ids the sample has (a captured one lacks its last output id as an input)
        known = [*sample.input_ids, *sample.uncaptured]
        first = sample.n_prompt - 1
        out = [(first + i, int(known[first + i + 1]), lp) for i, lp in enumerate(sample.logprobs)
               if 0 <= first + i < n and first + i + 1 < len(known) and lp > NO_LOGPROB]
        if self.limit and len(out) > self.limit:
            rng = random.Random(zlib.crc32(f"{sample.dataset}/{sample.id}".encode()))
            out = sorted(rng.sample(out, self.limit))
        return out

    def measure(self, sample: Any, final: torch.Tensor) -> Checked:
        """The worst gap of ``final`` [n, H] (the sample's first n positions)."""
        rows = self.rows(sample, final.shape[0])
        if not rows:
            return Checked(0, 0.0, -1, 0.0)
        where = torch.tensor([r[0] for r in rows])
        tokens = torch.tensor([r[1] for r in rows], device=self.device)
        theirs = torch.tensor([r[2] for r in rows], dtype=torch.float32, device=self.device)
        with torch.no_grad():
            h = final[where].to(device=self.device, dtype=torch.float32)
            logits = h @ self.weight.T
            ours = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
            gap = (ours - theirs).abs()
            z = logits.gather(1, tokens[:, None])[:, 0].abs() + logits.abs().amax(dim=-1)
            allowed = self.atol + RTOL.get(final.dtype, RTOL[torch.bfloat16]) * z
            excess = gap - allowed
        worst = int(excess.argmax())
        return Checked(len(rows), float(gap.max()), rows[worst][0], float(excess[worst]))

    def check(self, sample: Any, final: torch.Tensor) -> Checked:
        """``measure``, raising StateCheckFailed (naming the gap) past the tolerance."""
        result = self.measure(sample, final)
        if result.excess > 0:
            raise StateCheckFailed(
                f"final states do not give the server's log-probabilities: gap "
                f"{result.gap:.4g} nats at position {result.position} (allowed "
                f"{result.gap - result.excess:.4g}; {result.positions} positions checked)",
                result)
        return result

