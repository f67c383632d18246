"""Rebuilding the ledger from the records on disk, which are the truth.

Used on restart (the producer does it for datasets Redis knows nothing of) and
after Redis lost its data (``datagen recover``). Records written by an earlier
version are adopted when their token count is known; the rest are reported and
their samples regenerated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from datagen import keys
from datagen.generation.index import choose_entries
from datagen.generation.ledger import Ledger
from datagen.generation.records import records_dir

log = logging.getLogger(__name__)


@dataclass
class Rebuilt:
    dataset: str
    samples: int = 0
    tokens: int = 0
    old_format: int = 0
    unknown_tokens: int = 0
    duplicates: int = 0
    problems: list[str] = field(default_factory=list)
    closed: bool = False

    def line(self, budget: int) -> str:
        text = f"{self.dataset}: {self.samples} records, {self.tokens:,} tokens"
        if self.old_format:
            text += (f"; {self.old_format} in an older format ({self.unknown_tokens} without "
                     "token counts, not counted, will be regenerated)")
        if self.problems:
            text += f"; {len(self.problems)} unreadable lines"
        if self.tokens >= budget:
            text += f" >= budget {budget:,}, closed"
        return text


def rebuild_dataset(ledger: Ledger, dataset: str) -> Rebuilt:
    """Replace the dataset's ledger state with what its records on disk say."""
    out = Rebuilt(dataset)
    # Entries, not records: the counts need no token ids (see ``index``).
    chosen, problems, out.duplicates = choose_entries(
        records_dir(ledger.settings.output_dir, dataset))
    out.problems = [str(p) for p in problems]
    done: dict[str, str] = {}
    stats = {"tokens": 0, "prompt_tokens": 0, "completion_tokens": 0, "samples": 0,
             "truncated": 0}
    lengths: list[int] = []
    for sid, e in chosen.items():
        if not e.is_current():
            out.old_format += 1
        counted = e.counted_tokens(ledger.settings.budget_counts)
        if counted is None:
            out.unknown_tokens += 1
            continue
        completion = int(e.completion_tokens or e.output_len or 0)
        done[sid] = f"{'adopted' if e.rid is None else e.rid} {counted}"
        stats["tokens"] += counted
        stats["prompt_tokens"] += int(e.prompt_tokens or 0)
        stats["completion_tokens"] += completion
        stats["samples"] += 1
        stats["truncated"] += int(e.truncated)
        lengths.append(completion)
    _store(ledger, dataset, done, stats, lengths)
    out.samples, out.tokens = stats["samples"], stats["tokens"]
    out.closed = out.tokens >= ledger.budget(dataset)
    if out.closed:
        ledger.close(dataset, "budget")  # a close with another reason stays as it was
    elif ledger.settings.max_samples and out.samples >= ledger.settings.max_samples:
        ledger.close(dataset, "max_samples")
    if ledger.closed(dataset):
        ledger.drop_pending(dataset)
    return out


def _store(ledger: Ledger, dataset: str, done: dict[str, str], stats: dict[str, int],
           lengths: list[int]) -> None:
    r = ledger.r
    k = ledger.k
    # Counters the records decide are overwritten; the others (dead, revoked, reaped, ...)
    # and the close flag with its reason are kept. Callers hold the run marker off meanwhile,
    # so no worker commits while this is written.
    with r.pipeline() as pipe:
        for part in (keys.DONE, keys.LENGTHS, keys.SPEEDS, keys.MODEL):
            pipe.delete(k(dataset, part))
        if done:
            pipe.hset(k(dataset, keys.DONE), mapping=done)
            pipe.hdel(k(dataset, keys.PENDING), *done)
            pipe.zrem(k(dataset, keys.PARKED), *done)
        pipe.hset(k(dataset, keys.STATS), mapping=stats)
        if lengths:
            pipe.lpush(k(dataset, keys.LENGTHS), *lengths[-keys.LENGTHS_KEPT:])
        pipe.sadd(keys.DATASETS, dataset)
        pipe.execute()
    ledger.refresh_model(dataset)


def needs_rebuild(ledger: Ledger, dataset: str) -> bool:
    """Redis knows nothing of a dataset that has records on disk (with the run marker in
    place: without it, every dataset on disk is rebuilt)."""
    has_records = any(records_dir(ledger.settings.output_dir, dataset).glob("*.jsonl"))
    return has_records and not ledger.r.exists(ledger.k(dataset, keys.STATS))
