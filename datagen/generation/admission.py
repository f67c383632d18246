"""The length model the budget guard admits requests by (read by ``lua/admit.lua``).

A dataset's response lengths are learnt from its own completed responses, with the
requests still in flight as censored observations (they are known to be longer than
their progress so far), by Kaplan–Meier. Admission then needs, for an in-flight request
at progress p, E[L | L > p] and Var[L | L > p]: the model is that table.

The model exists from the first completed response on. Early it is safe because it is
mostly prior: PSEUDO_CENSORED pseudo-observations censored at the longest length seen put
at least 2/(n + 2) of the mass at the cap after n responses (67% after one, 11% after 16),
and every request in flight is a censored observation at its progress, so the mass past
the progress of the requests still running stays at the cap too. Admission also keeps the
worst-case rule (every request at its cap) as a floor: whatever fits at the caps is admitted.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from collections.abc import Mapping
from typing import Any, NamedTuple

PRIOR_MEAN_TOKENS = 2048
PRIOR_TOKENS_PER_S = 50.0
# Responses before the model replaces the caps (admission_min_responses); 16 until v3.
MODEL_MIN_SAMPLES = 1
PSEUDO_CENSORED = 2
MODEL_POINTS = 96
TAIL_POINTS = 32


def length_model(lengths: list[int], decoded: float, decode_s: float,
                 censored: list[float] | None = None, cap: int | None = None,
                 min_samples: int = MODEL_MIN_SAMPLES) -> dict[str, Any] | None:
    """Table of E[L | L > t] for admission, learnt from the dataset's own responses.

    Completed lengths alone are biased short (short responses finish first), so
    requests still in flight count as censored observations (L > progress so far)
    in a Kaplan–Meier estimate of the survival curve S. Then
    E[L | L > t] = t + (integral of S from t to the cap) / S(t). Mass that KM
    leaves beyond the longest observation is put at the cap (max_new_tokens):
    conservative, and it shrinks as requests complete.
    ``t``/``m``/``v`` are the table (threshold, conditional mean, conditional variance),
    ``tail`` the mean excess past the last threshold, ``mean``/``var`` of L, ``rate``
    tokens per second of one request (turns elapsed time into progress).
    """
    if not lengths or len(lengths) < min_samples:
        return None
    # Two pseudo-observations censored at the longest length seen: a few dozen samples
    # cannot rule out longer responses, so part of the mass stays up to the cap. Their
    # weight fades as samples accumulate (2 in 4,096 at most).
    longest = max(lengths)
    censored = list(censored or []) + [float(longest)] * PSEUDO_CENSORED
    points, survival = _kaplan_meier(lengths, censored)
    top = max(longest, max(censored))
    cap = max(cap or top, top)
    # Area under S and under 2u·S(u) to the right of each point (first and second
    # moments), with the leftover mass at the cap.
    areas, areas2 = [0.0] * len(points), [0.0] * len(points)
    area = survival[-1] * (cap - points[-1])
    area2 = survival[-1] * (cap * cap - points[-1] ** 2)
    for i in range(len(points) - 1, -1, -1):
        areas[i], areas2[i] = area, area2
        if i:
            area += survival[i - 1] * (points[i] - points[i - 1])
            area2 += survival[i - 1] * (points[i] ** 2 - points[i - 1] ** 2)
    mean = area + points[0]  # S = 1 on [0, first point)
    second = area2 + points[0] ** 2
    step = max(1, len(points) // MODEL_POINTS)
    # Quantile-spaced points, plus every one of the last TAIL_POINTS: the long requests
    # still in flight at the end of a dataset are the ones whose estimate decides the stop.
    picked = sorted(set(range(0, len(points), step)) |
                    set(range(max(0, len(points) - TAIL_POINTS), len(points))))
    thresholds, means, variances = [0], [mean], [max(0.0, second - mean * mean)]
    for i in picked:
        if survival[i] <= 1e-9:
            break
        m1 = points[i] + areas[i] / survival[i]
        m2 = points[i] ** 2 + areas2[i] / survival[i]
        thresholds.append(int(points[i]))
        means.append(m1)
        variances.append(max(0.0, m2 - m1 * m1))
    if cap > thresholds[-1]:
        # Past the last point a request can only end between where it is and the cap.
        thresholds.append(int(cap))
        means.append(float(cap))
        variances.append(0.0)
    tail = means[-1] - thresholds[-1]
    rate = decoded / decode_s if decode_s > 0 else PRIOR_TOKENS_PER_S
    return {"t": thresholds, "m": means, "v": variances, "tail": max(1.0, tail),
            "mean": mean, "var": variances[0], "rate": rate, "n": len(lengths),
            "censored": len(censored) - PSEUDO_CENSORED}


def stored(model: dict[str, Any]) -> dict[str, Any]:
    """The model as admission reads it: the means and variances rounded up to whole
    tokens (rounding up only ever reserves more, under a token each; it made the JSON the
    model was stored as before ``encode_model`` 40% cheaper to decode)."""
    whole = {k: math.ceil(model[k]) for k in ("mean", "var", "tail")}
    return {**model, **whole, "m": [math.ceil(x) for x in model["m"]],
            "v": [math.ceil(x) for x in model["v"]]}


def encode_model(model: dict[str, Any]) -> bytes:
    """``stored(model)`` as MessagePack, every number a double: what lua/_lib.lua's
    read_model decodes on every admit, about twice as fast as the same model in JSON
    (cmsgpack reads 8 bytes a number, cjson parses text)."""
    return _msgpack(stored(model))


def _msgpack(value: Any) -> bytes:
    """The MessagePack of a model: maps of short str keys, lists, and numbers (as float 64,
    exact for integers below 2^53)."""
    if isinstance(value, Mapping):
        out = [b"\xde" + struct.pack(">H", len(value))]
        for key, item in value.items():
            name = key.encode()
            if len(name) > 31:
                raise ValueError(f"model key {key!r} is longer than a fixstr")
            out += [bytes([0xA0 | len(name)]), name, _msgpack(item)]
        return b"".join(out)
    if isinstance(value, list | tuple):
        head = b"\xdd" + struct.pack(">I", len(value))
        if all(_is_number(x) for x in value):  # the model's lists: one pack for all of them
            return head + struct.pack(">" + "Bd" * len(value),
                                      *(v for x in value for v in (0xCB, x)))
        return head + b"".join(map(_msgpack, value))
    if _is_number(value):
        return b"\xcb" + struct.pack(">d", value)
    raise TypeError(f"a model holds numbers, lists and maps, not {type(value).__name__}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _kaplan_meier(events: list[int], censored: list[float]
                  ) -> tuple[list[float], list[float]]:
    """Distinct observation points and the survival S(t) just after each (the observations
    counted per point: a refresh reads up to LENGTHS_KEPT lengths, four times a second)."""
    deaths = Counter(map(float, events))
    removed = deaths.copy()
    removed.update(map(float, censored))
    at_risk = len(events) + len(censored)
    points = sorted(removed)
    survival: list[float] = []
    s = 1.0
    for t in points:
        died = deaths.get(t, 0)
        if died:
            s *= 1.0 - died / at_risk
        at_risk -= removed[t]
        survival.append(s)
    return points, survival


# lua/_lib.lua's buckets: "<start * CAP_CLASSES + class>" -> "<sum of caps * BUCKET_COUNT +
# requests>", "_prompt" -> prompt tokens in flight; "<start>:<cap>" -> requests, before classes.
CAP_CLASSES = 64
BUCKET_COUNT = 1 << 24


class Bucket(NamedTuple):
    start: float  # Redis time (s) the bucket begins at: its requests started then or later
    count: int
    caps: int  # the sum of its requests' max_new_tokens

    @property
    def cap(self) -> float:
        return self.caps / self.count if self.count else 0.0


def cap_class(cap: int) -> int:
    """lua/_lib.lua's cap_class: the double octave of max_new_tokens ([4^k, 4^(k + 1)))."""
    return min(CAP_CLASSES - 1, (max(1, cap).bit_length() - 1) // 2)


def bucket_field(now: float, cap: int, cap_max: int, rate: float) -> str:
    """lua/_lib.lua's bucket_field: the field a request admitted at ``now`` is counted in
    (for the benchmark, which writes in-flight state directly)."""
    width = max(1, min(60, math.floor(cap_max / max(rate, 1e-3) / 32)))
    return str(math.floor(now / width) * width * CAP_CLASSES + cap_class(cap))


def read_buckets(raw: Mapping[str, str]) -> list[Bucket]:
    """The buckets hash as rows, empty ones left out."""
    out = []
    for name, value in raw.items():
        if name.isdigit():
            caps, count = divmod(int(value), BUCKET_COUNT)
            out.append(Bucket(float(int(name) // CAP_CLASSES), count, caps))
        elif ":" in name:
            start, cap = name.split(":")
            out.append(Bucket(float(start), int(value), int(value) * int(cap)))
    return [b for b in out if b.count > 0]


def censored_progress(buckets: Mapping[str, str], now: float, rate: float | None
                      ) -> list[float]:
    """Progress so far of the requests in flight (censored lengths), from the buckets:
    each bucket's requests at its start, capped at their mean max_new_tokens."""
    if not rate:
        return []
    out: list[float] = []
    for b in read_buckets(buckets):
        out.extend([min(max(0.0, now - b.start) * rate, b.cap)] * b.count)
    return out
