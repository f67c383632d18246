"""Recovery from a lost segment holder: a SIGKILLed holder takes the bytes of every sample it
held, and SpecForge 0.2.0's stock consumer fails on the first ref whose bytes are gone
(``KeyError`` in ``MooncakeFeatureStore.get``, the loader fails the ref non-retryably, the
consumer writes ``refs.jsonl.consumer_failed`` and exits 1). It has already committed that ref
and every ref it polled with it to its SQLite ledger, and a consumer resumed from its
checkpoint requeues those very refs (same sample id, same generation) — so a re-publication
under a fresh id would not help: the requeued ref would fail again.

What does help: put the sample's recomputed states back under the keys the published ref
names (``<store_id>/<sample_id>/g<generation>/<feature>``, SpecForge 0.2.0's key layout), in the
new holder's segment. The ref, its id and the ledger's count of it stay as they were; the
consumer (live, or resumed from its checkpoint) reads it once and acks it once. Nothing is
regenerated: the states are recomputed from the sample's durable record by the caller.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from datagen.errors import BadInput
from datagen.stream.ledger import in_epoch

if TYPE_CHECKING:
    import torch

Recompute = Callable[[str], "dict[str, torch.Tensor]"]  # sample id -> the file build's tensors


def published_refs(channel_path: str | Path) -> list[Any]:
    """Every SampleRef on the channel (complete lines), in publication order."""
    from specforge.runtime.data_plane.ref_serialization import ref_from_dict

    try:
        text = Path(channel_path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [ref_from_dict(json.loads(line)) for line in text.split("\n")[:-1] if line.strip()]


def feature_key(store: Any, ref: Any, name: str) -> str:
    """SpecForge 0.2.0's key of one feature: <store_id>/<sample_id>/g<generation>/<name>."""
    return str(store._tkey(ref.sample_id, int(ref.metadata["generation"]), name))


def readable(store: Any, ref: Any) -> bool:
    """Every feature of the ref is in the store (SpecForge's own existence check)."""
    return all(store._store_exists(feature_key(store, ref, n)) for n in ref.feature_specs)


def lost_refs(store: Any, channel_path: str | Path, acked: set[str], epoch: int) -> list[Any]:
    """The epoch's published refs the consumer has not acknowledged whose bytes are gone."""
    return [ref for ref in published_refs(channel_path)
            if in_epoch(ref.sample_id, epoch) and ref.sample_id not in acked
            and not readable(store, ref)]


def restore(store: Any, ref: Any, streamed: dict[str, torch.Tensor]) -> int:
    """Put recomputed states (the stream's names) back under the ref's own keys; the bytes
    put. Refused, nothing put, when they are not the shapes and dtypes the ref names."""
    for name, spec in ref.feature_specs.items():
        t = streamed.get(name)
        if t is None or list(t.shape) != list(spec.shape) \
                or str(t.dtype).removeprefix("torch.") != spec.dtype:
            got = None if t is None else (list(t.shape), str(t.dtype))
            raise BadInput(f"recomputed {ref.sample_id} feature {name!r} is {got}, its "
                           f"published ref says {list(spec.shape)} {spec.dtype}: the "
                           "recomputation does not match what was published")
    size = 0
    for name in ref.feature_specs:
        t = streamed[name].contiguous()
        store._store_put_tensor(feature_key(store, ref, name), t)
        size += t.numel() * t.element_size()
    return size


def restore_if_lost(store: Any, channel_path: str | Path, acked: set[str], sample_id: str,
                    streamed: dict[str, torch.Tensor]) -> int:
    """A re-put of a published id: its states back under its ref if the holder lost them and
    the consumer has not acknowledged it; else 0 (nothing to do)."""
    if sample_id in acked:
        return 0
    refs = [r for r in published_refs(channel_path) if r.sample_id == sample_id]
    return sum(restore(store, r, streamed) for r in refs if not readable(store, r))
