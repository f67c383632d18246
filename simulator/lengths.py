"""What a simulated request generates: a seeded length and seeded token ids.

The output is a pure function of (seed, prompt ids, sampling_seed, the length-related sampling
params), so sending the same request twice gives the same tokens and tests can compare the
records a client wrote with the simulator's request log.
"""

import hashlib
import json
import math
import random
import zlib
from array import array
from dataclasses import dataclass, field
from itertools import accumulate

from simulator.config import SimulatorConfig, parse_lengths

_WORD = array("I").itemsize


@dataclass(frozen=True)
class OutputPlan:
    """The full output a request would produce if nothing stops it early."""

    ids: list[int]
    finish_reason: dict
    eos_token_id: int = 2
    # The decoded text of all ids, and where the text of the first k ids ends; a cumulative
    # stream chunk is then one slice instead of re-joining k words per chunk.
    text: str = field(init=False, repr=False, compare=False)
    text_ends: list[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        words = ["" if i == self.eos_token_id else f"tok{i}" for i in self.ids]
        ends = list(accumulate((len(w) + 1 if w else 0 for w in words), initial=0))
        object.__setattr__(self, "text", " ".join(w for w in words if w))
        # Each word but the first is preceded by one space; drop the first word's share.
        object.__setattr__(self, "text_ends", [max(0, e - 1) for e in ends])

    def text_upto(self, count: int) -> str:
        return self.text[: self.text_ends[count]]


def plan_output(
    config: SimulatorConfig,
    input_ids: list[int],
    max_new_tokens: int,
    sampling_seed: int | None = None,
    min_new_tokens: int = 0,
    ignore_eos: bool = False,
    stop_token_ids: tuple[int, ...] = (),
) -> OutputPlan:
    digest = _request_digest(config.seed, input_ids, sampling_seed)
    natural = _natural_length(config, random.Random(digest[:16]))
    # SGLang masks EOS until min_new_tokens are out, so EOS comes at min_new_tokens + 1 at best.
    natural = max(natural, min_new_tokens + 1)
    id_rng = random.Random(digest[16:])
    if ignore_eos or natural > max_new_tokens:
        ids = _body_ids(id_rng, max_new_tokens, config)
        return _stop_early(OutputPlan(ids, {"type": "length", "length": max_new_tokens},
                                      config.eos_token_id), stop_token_ids, min_new_tokens)
    # Stop on EOS: the EOS id is the last output id, as with skip_special_tokens only the text
    # drops it.
    ids = _body_ids(id_rng, natural - 1, config) + [config.eos_token_id]
    return _stop_early(OutputPlan(ids, {"type": "stop", "matched": config.eos_token_id},
                                  config.eos_token_id), stop_token_ids, min_new_tokens)


def _stop_early(plan: OutputPlan, stop_token_ids: tuple[int, ...],
                min_new_tokens: int) -> OutputPlan:
    """The plan cut at the first of ``stop_token_ids`` it makes (not before min_new_tokens).

    As on SGLang the matched id is the last output id and the finish reason names it; the
    output ids are what they would be without the stop ids, so a test can pick a stop id
    from a first answer.
    """
    stops = set(stop_token_ids)
    for index, token in enumerate(plan.ids):
        if token in stops and index + 1 > min_new_tokens:
            return OutputPlan(plan.ids[: index + 1], {"type": "stop", "matched": token},
                              plan.eos_token_id)
    return plan


def tokenize_text(text: str, config: SimulatorConfig) -> list[int]:
    """One token per whitespace-separated word; good enough to make `text` requests work."""
    return [_avoid_eos(zlib.crc32(word.encode()) % (config.vocab_size - 1), config)
            for word in text.split()]


def output_sha(ids: list[int]) -> str:
    """sha256 of the ids as compact JSON (`[1,2,3]`): what the request log records."""
    return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()


def _request_digest(seed: int, input_ids: list[int], sampling_seed: int | None) -> bytes:
    h = hashlib.sha256(f"{seed}|{sampling_seed}|".encode())
    h.update(array("q", input_ids).tobytes())
    return h.digest()


def _natural_length(config: SimulatorConfig, rng: random.Random) -> int:
    mode, low, high = parse_lengths(config.lengths)
    if mode == "fixed":
        return low
    if mode == "uniform":
        return rng.randint(low, high)
    # mu chosen so that the lognormal's mean (exp(mu + sigma^2 / 2)) is mean_output_tokens.
    mu = math.log(config.mean_output_tokens) - config.sigma**2 / 2
    return max(1, round(rng.lognormvariate(mu, config.sigma)))


def _body_ids(rng: random.Random, count: int, config: SimulatorConfig) -> list[int]:
    # One randbytes call per request instead of `count` randrange calls: plans are made on the
    # HTTP threads while hundreds of requests arrive at once.
    words = array("I")
    words.frombytes(rng.randbytes(_WORD * count))
    span = config.vocab_size - 1
    eos = config.eos_token_id
    return [v + (v >= eos) for v in (w % span for w in words)]


def _avoid_eos(value: int, config: SimulatorConfig) -> int:
    return value + (value >= config.eos_token_id)
