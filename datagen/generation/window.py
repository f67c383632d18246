"""The training window: what of a generated row can train, and what generation may add to it.

SpecForge trains on the first ``train_max_length`` positions of a row (its ``data.max_length``;
``extract_overlong = "skip"`` drops a longer row whole instead of cutting it). A generated
token past that window costs GPU time, budget and disk and never trains. With
``cap_to_window`` each request's ``max_new_tokens`` is capped at what the window leaves after
its prompt (``room``); a prompt that leaves fewer than ``min_trainable_tokens`` is never sent.
``budget_counts = "trainable"`` counts what SpecForge trains of a sample's row (``trainable``):
its generated tokens inside the window, less the row's last position, whose loss SpecForge
zeroes (nothing follows it: ``loss_mask[0, -1] = 0`` in its offline normaliser,
specforge/algorithms/eagle3/data.py). A 1-token answer trains nothing and counts 0.
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
    """The positions of a row SpecForge trains: the generated ids after ``n_prompt`` (or of
    each span) below ``window``, the row's last kept position excepted (its loss is zeroed:
    no next token); none when the row is longer than the window and ``overlong`` is "skip"
    (prepare drops it whole). ``n_total``: the row's length (a captured row ends one id
    before the answer's last: ``row_length``)."""
    if n_total > window and overlong == "skip":
        return 0
    kept = min(n_total, window)
    return sum(max(0, min(b, kept - 1) - a) for a, b in (spans or ((n_prompt, n_total),)))


def row_length(n_prompt: int, n_output: int, captured: bool) -> int:
    """The length of the row the trainer reads: prompt and answer, or with states captured
    while generating (extract_backend "captured") one id less (the last output id was never
    an input of the generation pass, so it has no states: extraction/files.py ``prepare``)."""
    return n_prompt + n_output - (1 if captured and n_output else 0)


def cut_at_window(n_total: int, window: int) -> bool:
    """Whether a row cut at max_new_tokens reaches the window: the trainer cuts it there
    anyway, so the generation lost nothing that trains, and ``keep_truncated = false`` keeps
    it (with ``cap_to_window`` every answer capped by the window is such a row)."""
    return n_total >= window


def cap_share(n_prompt: int, cap: int, window: int) -> int:
    """Of a request's ``cap`` tokens, how many fall inside the window (what can train
    if it generates to its cap)."""
    return min(cap, room(n_prompt, window))
