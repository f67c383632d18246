"""Multi-turn regeneration (``regenerate = "all"``): one sample's assistant turns, in order.

Each turn is one SGLang request, sent with the lease's rid (the turns run one after
another, and SGLang frees a rid before it answers, so the rid is never twice in flight):
an abort of the ledger entry's rid by its exact value, which is how SGLang 0.5.23 matches
it, reaches whichever turn is running. The sample is one unit in the ledger: admitted once
for all its turns (reserving ``turns × max_new_tokens``), held by one lease from its first
turn to its commit, and committed once with the tokens of every turn. Turn k's prompt is
turn k-1's prompt + its output ids + the template's ids before turn k (that turn's close,
the next user turn, the generation prompt; ``ChatEncoder.encode_turns``): the generated ids
go into the history exactly, never decoded and re-tokenized, so the record's ids hold every
turn and one training row covers them all.

Before each later turn the ledger says whether the sample may go on. A dataset closed in the
meantime, a sample whose entry a reaper reclaimed, or a worker shutting down stops it: the
turns done are discarded (counted as ``discarded_tokens``), never committed half.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from datagen.client import Generation, SGLangClient
from datagen.generation.job import Job, Prompt


@dataclass(frozen=True)
class Conversation:
    """Every turn of one sample, generated."""

    prompt_ids: list[int]  # the last turn's prompt: every earlier turn's output inside it
    last: Generation
    turns: list[dict[str, Any]]  # per turn: rid, span [start, end) of its output, ...

    @property
    def completion_tokens(self) -> int:
        return sum(t["completion_tokens"] for t in self.turns)

    def as_generation(self) -> Generation:
        """The sample as one generation: what the ledger counts and the record stores.
        prompt_tokens are the ids of the row nobody generated (template and user turns)."""
        row = len(self.prompt_ids) + len(self.last.output_ids)
        generated = sum(t["span"][1] - t["span"][0] for t in self.turns)
        return Generation(self.last.output_ids, self.last.finish_reason, row - generated,
                          self.completion_tokens, sum(t["latency_s"] for t in self.turns),
                          self.last.text)


@dataclass(frozen=True)
class Stopped:
    """The sample stopped before its last turn was stored; nothing of it is committed."""

    reason: str  # closed | lost | stopping | context | aborted | truncated
    tokens: int  # generated before the stop (discarded)
    detail: str


def generate_turns(client: SGLangClient, job: Job, prompt: Prompt, rid: str,
                   params: Mapping[str, Any], keep_truncated: bool,
                   may_continue: Callable[[], str]) -> Conversation | Stopped:
    """Generate the sample's turns in order; ``may_continue`` answers "ok" or why not."""
    ids = list(prompt.prompt_ids)
    turns: list[dict[str, Any]] = []
    generated = 0
    gen: Generation | None = None
    for n in range(job.turns):
        if gen is not None:
            ids += gen.output_ids + _between(gen, prompt.turn_ids[n - 1])
            state = may_continue()
            if state != "ok":
                return Stopped(state, generated, f"stopped before turn {n + 1}: {state}")
        max_new = job.max_new_tokens
        limits = job.limits
        if limits is not None:
            # Never send what the server refuses (a 400 would dead-letter it all the same,
            # after a round trip and with the server's words instead of these).
            refusal = limits.refusal(len(ids))
            if refusal:
                return Stopped("context", generated,
                               f"turn {n + 1} of {job.turns}: the conversation's {refusal}")
            max_new = min(max_new, limits.room(len(ids)))
        share = window_share(job, prompt, ids, n) if job.window else 0
        if job.window:
            max_new = min(max_new, share)
            if max_new < 1:
                return Stopped("context", generated, f"turn {n + 1} of {job.turns}: no room "
                               f"left in the window of {job.window} tokens")
        gen = client.generate(ids, {**params, "max_new_tokens": max_new}, rid,
                              dataset=job.dataset)
        generated += gen.completion_tokens
        if gen.aborted:
            return Stopped("aborted", generated, f"turn {n + 1} aborted")
        # a turn cut at its share of the window lost nothing that trains (cap_to_window)
        if gen.truncated and not keep_truncated and not (job.window and max_new == share):
            return Stopped("truncated", generated, f"turn {n + 1} truncated at max_new_tokens "
                           "and keep_truncated is off")
        turns.append({"rid": rid, "span": [len(ids), len(ids) + len(gen.output_ids)],
                      "finish_reason": gen.finish_reason, "prompt_tokens": len(ids),
                      "completion_tokens": gen.completion_tokens, "latency_s": gen.latency_s})
    assert gen is not None  # job.turns >= 1
    return Conversation(ids, gen, turns)


def window_share(job: Job, prompt: Prompt, ids: list[int], n: int) -> int:
    """Turn n's cap under cap_to_window: what the window leaves after the row so far and the
    template's ids of the later turns, shared evenly among the turns still to come (what a
    turn leaves unused goes to the next, so no share is smaller than the first)."""
    later = sum(len(between) for between in prompt.turn_ids[n:])
    return (job.window - len(ids) - later) // (job.turns - n)


def _between(gen: Generation, between: list[int]) -> list[int]:
    # A turn that stopped on its stop token already wrote the template's close of the turn.
    if (gen.finish_reason.get("type") == "stop" and gen.output_ids and between
            and gen.output_ids[-1] == between[0]):
        return between[1:]
    return list(between)
