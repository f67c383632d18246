"""The training window: what of a generated row can train, and what generation may add to it.

SpecForge trains on the first ``train_max_length`` positions of a row (its ``data.max_length``;
``extract_overlong = "skip"`` drops a longer row whole instead of cutting it). A generated
token past that window costs GPU time, budget and disk and never trains. With
``cap_to_window`` each request's ``max_new_tokens`` is capped at what the window leaves after
its prompt (``room``); a prompt that leaves fewer than ``min_trainable_tokens`` is never sent.
``budget_counts = "trainable"`` counts a sample's generated tokens inside the window
(``trainable``).
"""

from __future__ import annotations

from collections.abc import Sequence

Spans = Sequence[Sequence[int]]  # [start, end) of each generated turn in the row


def room(fixed_tokens: int, window: int) -> int:
    """The tokens a sample may generate with its whole row inside the window:
    ``fixed_tokens`` are the row's ids nobody generates (the prompt and, for a multi-turn
    sample, the template's ids between its turns)."""
    return max(0, window - fixed_tokens)


def trainable(n_prompt: int, n_total: int, window: int, overlong: str,
              spans: Spans = ()) -> int:
    """The generated tokens of a row that lie inside the window: all of the generated ids
    after ``n_prompt`` (or of each span) below ``window``; none when the row is longer
    than the window and ``overlong`` is "skip" (prepare drops it whole)."""
    if n_total > window and overlong == "skip":
        return 0
    kept = min(n_total, window)
    return sum(max(0, min(b, kept) - a) for a, b in (spans or ((n_prompt, n_total),)))


def cap_share(n_prompt: int, cap: int, window: int) -> int:
    """Of a request's ``cap`` tokens, how many fall inside the window (what can train
    if it generates to its cap)."""
    return min(cap, room(n_prompt, window))
