"""After a lost segment holder: the shards whose samples' states went with it run again.

The stock consumer fails on a ref whose bytes are gone, and its resume requeues the same ref
(DESIGN "A SIGKILLed segment holder"), so those samples' states must come back under the refs
already published. `datagen extract` (stream) calls ``reopen_lost`` before it enqueues: the
epoch's lost ids leave the stream ledger's published list (StreamSink.forget_lost) and the
done shards holding them are reopened, so their re-run recomputes exactly those samples by
prefill (the rest are published: skipped) and its puts restore the bytes under their refs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from datagen.extraction.files import read_shard
from datagen.extraction.ledger import ExtractionLedger, ShardState


def _record_key(sample_id: str) -> str:
    """``<dataset>/<id>`` of a stream id ``<dataset>/<id>@e<epoch>``."""
    return sample_id.rsplit("@e", 1)[0]


def shards_holding(ids: Sequence[str], shards: Sequence[ShardState], output_dir: str | Path
                   ) -> list[str]:
    """The shards (their paths) whose records are any of the stream ids ``ids``."""
    wanted = {_record_key(sid) for sid in ids}
    found = []
    for shard in shards:
        for _, rec in read_shard(Path(output_dir) / shard.path):
            if isinstance(rec, dict) and f"{rec.get('dataset')}/{rec.get('id')}" in wanted:
                found.append(shard.path)
                break
    return found


def reopen_lost(sink: Any, xl: ExtractionLedger, shards: Sequence[ShardState],
                output_dir: str | Path) -> tuple[list[str], list[str]]:
    """(lost ids, shards reopened): nothing when the holder kept every unacked sample."""
    lost = sink.forget_lost()
    if not lost:
        return [], []
    reopened = shards_holding(lost, shards, output_dir)
    xl.reopen(reopened)
    return lost, reopened
