"""Every sample's states proved against the engine's own output (``check_states``).

The generation server answers each sampled token's log-probability (vLLM's ``raw_logprobs``:
the log-softmax of the model's logits before any sampling transform; datagen/servers/vllm.py),
and the record keeps them (``output_logprobs``). The model's log-probability of output id i is
``log_softmax(lm_head(h))`` at that id, where h is the final state of the position before it
(prompt length − 1 + i): the post-norm state every backend stores as ``hidden_state``
(SpecForge's TargetHead applies ``lm_head`` to it and nothing else). So a file whose final
states are the model's, in line with its ids, gives back the server's numbers; a file whose
states are shifted by a position, come from another layer or another request, does not.

Before any of that every value of the sample's states, aux and final, every position (the
prompt's too), must be finite: one NaN or inf fails the sample (``nonfinite``), whatever the
log-probabilities say (a NaN gap compares false with every bound).

The gap is allowed ``atol + rtol · (|z_t| + max_j |z_j|)`` nats (tolerance.py: rtol from the
server's dtype and the path, atol ``check_atol_nats``); logits that overflow to inf fail the
sample too. On a GPU every position is checked; on a CPU a fixed random subset of
``check_positions_cpu`` (seeded by the sample's id). The check only reads the final state and
multiplies it by ``lm_head`` in float32, ``CHUNK_BYTES`` of logits at a time (a window of
8,192 positions at Kimi-K2.5's 163,840-token vocabulary would be 5.4 GB a tensor at once):
no forward pass.
"""

from __future__ import annotations

import json
import math
import random
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from datagen.extraction.tolerance import Tolerance

LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")
EMBED_KEYS = ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight")
NO_LOGPROB = -9999.0  # vLLM's floor: a token it had no log-probability for
CHUNK_BYTES = 256 << 20  # float32 logits computed at once (two such tensors live at the peak)
FINITE_ROWS = 1024       # positions scanned for non-finite values at once


@dataclass(frozen=True)
class Checked:
    positions: int  # positions compared (0: the sample carries no log-probabilities)
    gap: float      # the worst |ours - server's| in nats
    position: int   # where (index into the sample's ids)
    excess: float   # the worst gap minus what its position allows (> 0: failed)
    nonfinite: int = 0  # values of the states (or checked positions' logits) not finite
    recaptured: bool = False  # compared with a prefill of the same ids (recapture.py)


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
        if not result.positions and not failed:
            self.unchecked += 1
            return
        self.checked += 1
        self.failed += failed
        self.positions += result.positions
        if math.isfinite(result.gap):
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


def first_nonfinite(states: torch.Tensor) -> tuple[int, int]:
    """(values not finite, first position holding one; -1 if none) of ``states`` [n, W]."""
    count, first = 0, -1
    for start in range(0, states.shape[0], FINITE_ROWS):
        bad = ~torch.isfinite(states[start:start + FINITE_ROWS])
        found = int(bad.sum())
        if found and first < 0:
            first = start + int(bad.any(dim=-1).nonzero()[0, 0])
        count += found
    return count, first


def require_finite(aux: torch.Tensor | None, final: torch.Tensor) -> None:
    """StateCheckFailed naming the tensor, the count and the first position when a value
    of ``aux`` [n, 3H] or ``final`` [n, H] is NaN or inf."""
    for name, states in (("aux_hidden_state", aux), ("hidden_state", final)):
        if states is None:
            continue
        count, first = first_nonfinite(states.reshape(-1, states.shape[-1]))
        if count:
            raise StateCheckFailed(
                f"{name} holds {count:,} values that are not finite (NaN or inf), the first "
                f"at position {first}", Checked(0, 0.0, first, math.inf, count))


class StateCheck:
    """Checks a sample's states: all finite, and the final ones [n, H] against its
    log-probabilities."""

    def __init__(self, weight: torch.Tensor | Callable[[], torch.Tensor],
                 device: torch.device, atol_nats: float, positions_cpu: int,
                 tolerance: Tolerance | None = None, chunk_positions: int | None = None):
        """``weight``: lm_head [V, H], or what loads it (on the first sample that has
        log-probabilities: a run without them never reads it). ``chunk_positions``: the
        positions whose logits are computed at once (None: what fits ``CHUNK_BYTES``;
        0: all at once)."""
        self.device = device
        self._weight = weight
        self._lock = threading.Lock()
        self.atol = atol_nats
        self.tolerance = tolerance or Tolerance()
        self.chunk_positions = chunk_positions
        self.limit = 0 if device.type == "cuda" else positions_cpu  # 0: every position

    @classmethod
    def for_model(cls, model_path: str, device: torch.device, atol_nats: float,
                  positions_cpu: int, tolerance: Tolerance | None = None) -> StateCheck:
        return cls(lambda: lm_head_weight(model_path), device, atol_nats, positions_cpu,
                   tolerance)

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
        # the prompt's positions (check_prompt_states), then the output's
        served = [*enumerate(sample.prompt_logprobs),
                  *((first + i, lp) for i, lp in enumerate(sample.logprobs))]
        out = [(p, int(known[p + 1]), lp) for p, lp in served
               if 0 <= p < n and p + 1 < len(known) and lp > NO_LOGPROB]
        if self.limit and len(out) > self.limit:
            rng = random.Random(zlib.crc32(f"{sample.dataset}/{sample.id}".encode()))
            out = sorted(rng.sample(out, self.limit))
        return out

    def chunk(self, vocab: int) -> int:
        """Positions whose logits [k, V] are computed at once."""
        if self.chunk_positions is not None:
            return self.chunk_positions
        return max(1, CHUNK_BYTES // (4 * vocab))

    def gaps(self, final: torch.Tensor, where: torch.Tensor, tokens: torch.Tensor,
             theirs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gap, excess) [k] of the positions ``where`` of ``final``, one chunk of logits
        at a time: logsumexp and amax/amin reduce without a second [k, V] copy of them."""
        weight = self.weight
        rtol = self.tolerance.rtol(final.dtype)
        step = self.chunk(weight.shape[0]) or len(where)
        gaps, excesses = [], []
        for start in range(0, len(where), step):
            part = slice(start, start + step)
            h = final[where[part]].to(device=self.device, dtype=torch.float32)
            logits = h @ weight.T
            z_t = logits.gather(1, tokens[part, None])[:, 0]
            gap = (z_t - torch.logsumexp(logits, dim=-1) - theirs[part]).abs()
            z = z_t.abs() + torch.maximum(logits.amax(dim=-1), -logits.amin(dim=-1))
            del logits
            gaps.append(gap)
            excesses.append(gap - (self.atol + rtol * z))
        return torch.cat(gaps), torch.cat(excesses)

    def measure(self, sample: Any, final: torch.Tensor) -> Checked:
        """The worst gap of ``final`` [n, H] (the sample's first n positions); a position
        whose logits are not finite (states huge enough to overflow) counts as failed."""
        rows = self.rows(sample, final.shape[0])
        if not rows:
            return Checked(0, 0.0, -1, 0.0)
        where = torch.tensor([r[0] for r in rows])
        tokens = torch.tensor([r[1] for r in rows], device=self.device)
        theirs = torch.tensor([r[2] for r in rows], dtype=torch.float32, device=self.device)
        with torch.no_grad():
            gap, excess = self.gaps(final, where, tokens, theirs)
        bad = ~torch.isfinite(excess)
        finite_gap = float(gap[~bad].max()) if not bool(bad.all()) else 0.0
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            return Checked(len(rows), finite_gap, rows[first][0], math.inf, int(bad.sum()))
        worst = int(excess.argmax())
        return Checked(len(rows), finite_gap, rows[worst][0], float(excess[worst]))

    def check(self, sample: Any, final: torch.Tensor,
              aux: torch.Tensor | None = None) -> Checked:
        """Every value of ``aux`` and ``final`` finite, then ``measure``; StateCheckFailed
        (naming what failed and where) otherwise."""
        require_finite(aux, final)
        result = self.measure(sample, final)
        if result.nonfinite:
            raise StateCheckFailed(
                f"final states give logits that are not finite at {result.nonfinite} of "
                f"{result.positions} positions checked, the first at position "
                f"{result.position}", result)
        if result.excess > 0:
            raise StateCheckFailed(
                f"final states do not give the server's log-probabilities: worst gap "
                f"{result.gap:.4g} nats; {result.excess:.4g} nats at position "
                f"{result.position} past what it allows ({result.positions} positions "
                "checked)",
                result)
        return result
