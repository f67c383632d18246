"""SpecForge's draft vocabulary mapping (``vocab_mapping.pt``) from counts gathered at write time.

SpecForge (checked at sgl-project/SpecForge a6b6b02) builds the mapping of an offline run in
``specforge/training/vocab_mapping.py`` (``count_effective_feature_tokens``) and
``specforge/data/preprocessing.py`` (``process_token_dict_to_mappings``):

- it walks the feature folder, sorts the file paths, and for each file adds the counts of
  ``input_ids[:max_length][loss_mask != 0]`` to one ``Counter``, token ids ascending per file;
- if fewer than ``draft_vocab_size`` distinct ids were seen, ids of ``range(draft_vocab_size)``
  are added at count 0 (in the iteration order of a set difference) until there are enough;
- it keeps ``Counter.most_common(draft_vocab_size)`` (ties go to the id counted first), sorts
  those ids ascending (``used``) and stores ``d2t[i] = used[i] - i`` (int64 ``[draft]``) and
  ``t2d[t] = t in used`` (bool ``[target]``).

The ties make the order in which ids were first counted part of the result. A gpu worker
therefore stores per shard, for every id, its count and the first file (in that sorted path
order) that counts it; merging the shards' counts rebuilds SpecForge's insertion order exactly,
without opening a single hidden-state file again.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from datagen.generation.records import atomic_file

log = logging.getLogger(__name__)

COUNTS_DIR = "vocab_counts"  # in the extraction folder: <shard name>.json per shard
COUNTS_VERSION = 1
MAPPING_NAME = "vocab_mapping.pt"


def count_samples(samples: Iterable[tuple[str, Sequence[int], Sequence[int]]]
                  ) -> dict[int, tuple[int, str]]:
    """id -> (count over loss-masked positions, first path counting it) for
    (path relative to the feature folder, input_ids, loss_mask) of the files as written."""
    out: dict[int, tuple[int, str]] = {}
    for path, ids, mask in samples:
        if len(ids) != len(mask):
            raise ValueError(f"{path}: {len(ids)} input ids but {len(mask)} loss-mask entries")
        for token, n in Counter(t for t, m in zip(ids, mask, strict=True) if m).items():
            count, first = out.get(token, (0, path))
            out[token] = (count + n, min(first, path))
    return out


def write_shard_counts(folder: Path, name: str, counts: Mapping[int, tuple[int, str]],
                       meta: Mapping[str, Any]) -> Path:
    """``<folder>/vocab_counts/<name>.json``, written atomically (a rerun of the shard
    replaces it with the counts of every file the shard has, old and new)."""
    paths = sorted({first for _, first in counts.values()})
    index = {p: i for i, p in enumerate(paths)}
    body = {"version": COUNTS_VERSION, **meta, "paths": paths,
            "tokens": [[t, c, index[f]] for t, (c, f) in sorted(counts.items())]}
    target = folder / COUNTS_DIR / f"{name}.json"
    with atomic_file(target) as fh:
        fh.write(json.dumps(body, separators=(",", ":")) + "\n")
    return target


def read_shard_counts(path: Path) -> tuple[dict[int, tuple[int, str]], dict[str, Any]]:
    """(counts, the rest of the file: what the worker recorded about the extraction)."""
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
        paths = body.pop("paths")
        counts = {int(t): (int(c), paths[i]) for t, c, i in body.pop("tokens")}
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"{path}: not a vocab counts file ({exc})") from exc
    return counts, body


def merge_counts(shards: Iterable[Mapping[int, tuple[int, str]]]) -> Counter:
    """One Counter whose insertion order is SpecForge's: by first file in sorted path order,
    then by id (it adds each file's ids ascending)."""
    total: dict[int, tuple[int, str]] = {}
    for counts in shards:
        for token, (n, first) in counts.items():
            count, seen = total.get(token, (0, first))
            total[token] = (count + n, min(seen, first))
    order = sorted(total, key=lambda t: (total[t][1], t))
    return Counter({t: total[t][0] for t in order})


def effective_draft_vocab(draft_vocab_size: int, target_vocab_size: int) -> int:
    """SpecForge refuses a draft vocabulary larger than the target's
    (``prepare_hidden_states.py``) and uses no mapping when they are equal: a target with a
    smaller vocabulary than the setting gets a draft vocabulary of the target's size."""
    if draft_vocab_size > target_vocab_size:
        log.info("draft_vocab_size %d > target vocab %d: using %d (the whole vocabulary)",
                 draft_vocab_size, target_vocab_size, target_vocab_size)
        return target_vocab_size
    return draft_vocab_size


def mappings(counts: Counter, draft_vocab_size: int, target_vocab_size: int
             ) -> tuple[list[int], list[bool]]:
    """(d2t, t2d) by SpecForge's rule (``process_token_dict_to_mappings`` at a6b6b02).

    The draft vocabulary is the ``draft_vocab_size`` most counted ids, ties going to the id
    counted first (``counts``' insertion order). When fewer ids were seen, SpecForge tops the
    list up with ids of ``range(draft_vocab_size)`` never seen, at count 0, in the order a
    Python set of them iterates (not always ascending: a set orders ints by hash slot), so the
    same set is built here. ``d2t[i]`` is the offset from draft id i to its target id."""
    ranked = sorted(counts, key=lambda token: -counts[token])  # stable: first counted first
    if len(ranked) < draft_vocab_size:
        unseen = set(range(draft_vocab_size)) - set(counts)
        ranked += list(unseen)[:draft_vocab_size - len(ranked)]
    chosen = sorted(ranked[:draft_vocab_size])
    members = set(chosen)
    return ([target - draft for draft, target in enumerate(chosen)],
            [token in members for token in range(target_vocab_size)])


def coverage(counts: Counter, d2t: Sequence[int]) -> float:
    """Share of the counted (loss-masked) tokens the draft vocabulary covers."""
    total = sum(counts.values())
    used = {d + i for i, d in enumerate(d2t)}
    return sum(n for t, n in counts.items() if t in used) / total if total else 0.0


def save_mapping(path: Path, d2t: Sequence[int], t2d: Sequence[bool]) -> Path:
    """``torch.save({"d2t": int64 [draft], "t2d": bool [target]})``, atomically."""
    import torch  # noqa: PLC0415 (only where the handoff is written)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    torch.save({"d2t": torch.tensor(list(d2t), dtype=torch.int64),
                "t2d": torch.tensor(list(t2d), dtype=torch.bool)}, tmp)
    os.replace(tmp, path)
    return path
