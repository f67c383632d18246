"""Rebuilding the ledger from the records on disk, which are the truth.

Used on restart (the producer does it for datasets Redis knows nothing of) and
after Redis lost its data (``datagen recover``). Records written by an earlier
version are adopted when their token count is known; the rest are reported and
their samples regenerated.

Memory stays flat in the records (``index``: ~30 bytes each), and Redis is written in
batches of REDIS_BATCH fields, so no one command (or reply) holds the whole done map.
"""

from __future__ import annotations

import json
import logging
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from datagen import keys
from datagen.generation.columns import each
from datagen.generation.index import LineReader, RecordIndex, build_index, choose_rows, entry
from datagen.generation.ledger import Ledger
from datagen.generation.records import records_dir

REDIS_BATCH = 10_000  # done fields per HSET (and ids per HDEL / ZREM) of a rebuild

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
    # An index, not records: the counts need no token ids (see ``index``).
    ix = build_index(records_dir(ledger.settings.output_dir, dataset),
                     output_dir=Path(ledger.settings.output_dir))
    out.problems = [str(p) for p in ix.problems]
    rows, first, out.duplicates = choose_rows(ix)
    stats = {"tokens": 0, "prompt_tokens": 0, "completion_tokens": 0, "samples": 0,
             "truncated": 0}
    completions = array("q")  # per chosen row; -1: not counted
    staging = ledger.k(dataset, keys.DONE_REBUILD)
    ledger.r.delete(staging)
    for done in _batches(_counted(ledger, ix, rows, out, stats, completions)):
        _store_batch(ledger, dataset, staging, done)
    _store(ledger, dataset, stats, _lengths(first, completions), bool(stats["samples"]))
    out.samples, out.tokens = stats["samples"], stats["tokens"]
    out.closed = out.tokens >= ledger.budget(dataset)
    if out.closed:
        ledger.close(dataset, "budget")  # a close with another reason stays as it was
    elif ledger.settings.max_samples and out.samples >= ledger.settings.max_samples:
        ledger.close(dataset, "max_samples")
    if ledger.closed(dataset):
        ledger.drop_pending(dataset)
    return out


def _counted(ledger: Ledger, ix: RecordIndex, rows: np.ndarray, out: Rebuilt,
             stats: dict[str, int], completions: array) -> Iterator[tuple[str, str]]:
    """(sample id, "rid tokens") of each chosen record whose tokens are known, read back
    in file order; the stats and completions are filled on the way."""
    with LineReader() as reader:
        for row in each(rows):
            path, offset, size = ix.where(row)
            record = json.loads(reader.raw(path, offset, size, "a record"))
            e = entry(record, path, offset, b"", False)
            if not e.is_current():
                out.old_format += 1
            counted = e.counted_tokens(ledger.settings.budget_counts,
                                       ledger.settings.train_max_length)
            if counted is None:
                out.unknown_tokens += 1
                completions.append(-1)
                continue
            completion = int(e.completion_tokens or e.output_len or 0)
            stats["tokens"] += counted
            stats["prompt_tokens"] += int(e.prompt_tokens or 0)
            stats["completion_tokens"] += completion
            stats["samples"] += 1
            stats["truncated"] += int(e.truncated)
            completions.append(completion)
            yield e.id, f"{'adopted' if e.rid is None else e.rid} {counted}"


def _batches(pairs: Iterator[tuple[str, str]]) -> Iterator[dict[str, str]]:
    batch: dict[str, str] = {}
    for sid, value in pairs:
        batch[sid] = value
        if len(batch) >= REDIS_BATCH:
            yield batch
            batch = {}
    if batch:
        yield batch


def _lengths(first: np.ndarray, completions: array) -> list[int]:
    """The last LENGTHS_KEPT known completions in the order the samples first appear on
    disk (what the length model learns from)."""
    known = np.frombuffer(completions, dtype=np.int64) if len(completions) else np.zeros(
        0, np.int64)
    order = np.argsort(first, kind="stable")
    ordered = known[order]
    return ordered[ordered >= 0][-keys.LENGTHS_KEPT:].tolist()


def _store_batch(ledger: Ledger, dataset: str, staging: str, done: dict[str, str]) -> None:
    """One batch of done fields into the staging hash; their samples leave pending and
    parked (a sample with a record on disk is done, whatever comes after)."""
    k = ledger.k
    with ledger.r.pipeline(transaction=False) as pipe:
        pipe.hset(staging, mapping=done)
        pipe.hdel(k(dataset, keys.PENDING), *done)
        pipe.zrem(k(dataset, keys.PARKED), *done)
        pipe.execute()


def _store(ledger: Ledger, dataset: str, stats: dict[str, int], lengths: list[int],
           staged: bool) -> None:
    r = ledger.r
    k = ledger.k
    # Counters the records decide are overwritten; the others (dead, revoked, reaped, ...)
    # and the close flag with its reason are kept. Callers hold the run marker off meanwhile,
    # so no worker commits while this is written. The done hash was staged batch by batch
    # under another key; one transaction puts it in place with the stats, so a rebuild cut
    # short leaves the ledger as it was (but for pending entries of samples done on disk).
    with r.pipeline() as pipe:
        for part in (keys.DONE, keys.LENGTHS, keys.SPEEDS, keys.MODEL, keys.MODEL_JSON):
            pipe.delete(k(dataset, part))
        if staged:
            pipe.rename(k(dataset, keys.DONE_REBUILD), k(dataset, keys.DONE))
        pipe.hset(k(dataset, keys.STATS), mapping=stats)
        for a in range(0, len(lengths), REDIS_BATCH):
            pipe.lpush(k(dataset, keys.LENGTHS), *lengths[a:a + REDIS_BATCH])
        pipe.sadd(keys.DATASETS, dataset)
        pipe.execute()
    ledger.refresh_model(dataset)


def needs_rebuild(ledger: Ledger, dataset: str) -> bool:
    """Redis knows nothing of a dataset that has records on disk (with the run marker in
    place: without it, every dataset on disk is rebuilt)."""
    has_records = any(records_dir(ledger.settings.output_dir, dataset).glob("*.jsonl"))
    return has_records and not ledger.r.exists(ledger.k(dataset, keys.STATS))
