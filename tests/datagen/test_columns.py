"""Merge, rebuild and prepare on flat columns give what the whole-record code gave.

The reference functions below are the rules as the code applied them to whole records before
the columns (``records.canonical``, Python's sort of (time, id) and (dataset, id), one
``random.shuffle``); the records are spread over several files with duplicates, equal times,
ids that share long prefixes or differ only past 24 bytes, non-ASCII and NUL-ended ids, and
copies the ledger committed in a later file.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from config.settings import Settings
from datagen import keys
from datagen.generation import recovery
from datagen.generation.columns import Ids, id_order
from datagen.generation.committed import Committed
from datagen.generation.ledger import Ledger, connect
from datagen.generation.merge import merge_dataset
from datagen.generation.records import (
    canonical,
    counted_tokens,
    iter_records,
    merged_path,
    records_dir,
)
from datagen.generation.recovery import rebuild_dataset
from datagen.training.training_set import prepare, shuffle_order, training_dir

LONG = "prefix-shared-by-many-samples-beyond-24-bytes/"  # ids that tie on their first chunks


def compact(rec: dict[str, Any]) -> str:
    return json.dumps(rec, separators=(",", ":"), ensure_ascii=False) + "\n"


def sample_ids(rng: random.Random, n: int) -> list[str]:
    ids = {f"s{i}" for i in range(n // 2)}
    ids |= {f"{LONG}{rng.randrange(10**6)}" for _ in range(n // 4)}
    ids |= {"é", "é\x00", "e", "\u2603", "a", "a\x00", "a\x00\x00", LONG, LONG + "\x00"}
    while len(ids) < n:
        ids.add("".join(rng.choice("ab\u00e9") for _ in range(rng.randrange(1, 30))))
    return sorted(ids)


def write_dataset(out: Path, dataset: str, seed: int, n: int = 400
                  ) -> tuple[dict[str, str], list[str]]:
    """Records of n samples over 4 files, a third written twice or three times; returns the
    done map a ledger would hold (a later copy's rid for some) and the ids."""
    rng = random.Random(seed)
    ids = sample_ids(rng, n)
    folder = records_dir(out, dataset)
    folder.mkdir(parents=True)
    files = [open(folder / f"w{w}.jsonl", "w", encoding="utf-8") for w in range(4)]
    committed: dict[str, str] = {}
    for i, sid in enumerate(rng.sample(ids, len(ids))):
        copies = rng.choice([1, 1, 2, 3])
        rids = [f"r{rng.randrange(4)}{i}-{c}" for c in range(copies)]
        for rid in rids:
            rec = {"v": 1, "id": sid, "dataset": dataset, "rid": rid,
                   "prompt_ids": [1] * rng.randrange(1, 5),
                   "output_ids": [2] * rng.randrange(0, 5), "truncated": rng.random() < 0.1,
                   "time": rng.choice([5.0, 7, 7.0, 8.5, rng.random() * 10])}
            rec["prompt_tokens"], rec["completion_tokens"] = (len(rec["prompt_ids"]),
                                                              len(rec["output_ids"]))
            if rng.random() < 0.05:
                del rec["time"]  # an older record: time 0
            line = compact(rec) if rng.random() < 0.9 else json.dumps(rec) + "\n"
            files[rng.randrange(4)].write(line)
        if rng.random() < 0.8:
            committed[sid] = f"{rng.choice(rids)} {len(rids)}"
    for fh in files:
        fh.close()
    return committed, ids


def reference_merge(out: Path, dataset: str, committed: dict[str, str] | None) -> bytes:
    chosen, _, _ = canonical(iter_records(records_dir(out, dataset)), committed)
    kept = [r for sid, r in chosen.items() if committed is None or sid in committed]
    kept.sort(key=lambda r: (r.get("time", 0), str(r["id"])))
    return "".join(compact(r) for r in kept).encode()


@pytest.mark.parametrize("with_ledger", [False, True], ids=["no-ledger", "ledger"])
def test_merge_on_columns_writes_what_the_whole_records_merge_wrote(
        tmp_path: Path, with_ledger: bool) -> None:
    committed, _ = write_dataset(tmp_path, "B1", seed=3)
    done = committed if with_ledger else None
    expected = reference_merge(tmp_path, "B1", done)

    report = merge_dataset(tmp_path, "B1", Committed.of(done))

    assert merged_path(tmp_path, "B1").read_bytes() == expected
    assert report.records == expected.count(b"\n") and report.duplicates > 50


def test_rebuild_on_columns_stores_what_the_whole_records_rebuild_stored(
        tmp_path: Path, redis_url: str) -> None:
    write_dataset(tmp_path, "B1", seed=4)
    chosen, _, duplicates = canonical(iter_records(records_dir(tmp_path, "B1")))
    done = {sid: f"{r['rid']} {counted_tokens(r, 'completion')}" for sid, r in chosen.items()}
    lengths = [r["completion_tokens"] for r in chosen.values()]  # in first-appearance order
    ledger = Ledger(connect(redis_url), Settings(redis_url=redis_url, output_dir=str(tmp_path),
                                                 token_budget=10**9))

    rebuilt = rebuild_dataset(ledger, "B1")

    assert (rebuilt.samples, rebuilt.duplicates) == (len(chosen), duplicates)
    assert ledger.committed("B1") == done
    # LPUSH puts the newest first: the list reads the lengths backwards
    assert [int(x) for x in ledger.r.lrange(ledger.k("B1", keys.LENGTHS), 0, -1)] == \
        lengths[::-1]
    stats = ledger.snapshot("B1")["stats"]
    assert stats["truncated"] == sum(bool(r["truncated"]) for r in chosen.values())
    assert not ledger.r.exists(ledger.k("B1", keys.DONE_REBUILD))


def test_prepare_on_columns_shuffles_and_fingerprints_as_before(tmp_path: Path) -> None:
    # Given: two datasets whose ids overlap (collisions: the later dataset's copy is dropped)
    done_a, _ = write_dataset(tmp_path, "A1", seed=5)
    done_b, _ = write_dataset(tmp_path, "B1", seed=5)  # the same ids, other records
    settings = Settings(output_dir=str(tmp_path), shard_samples=64, shuffle_seed=11,
                        keep_truncated=True)

    tset = prepare(settings, {"A1": Committed.of(done_a), "B1": done_b}, None)

    # Then: the rules as they ran on a list of whole records
    order, owner, collisions = [], {}, []
    for ds in ("A1", "B1"):
        for raw in merged_path(tmp_path, ds).read_bytes().splitlines(keepends=True):
            rec = json.loads(raw)
            if not rec["output_ids"]:
                continue
            if rec["id"] in owner:
                collisions.append((rec["id"], owner[rec["id"]], ds))
                continue
            owner[rec["id"]] = ds
            order.append((ds, rec["id"], hashlib.sha256(raw).hexdigest()))
    order.sort(key=lambda e: (e[0], e[1]))
    random.Random(11).shuffle(order)
    h = hashlib.sha256(b"v1 shard_samples=64\n")
    for ds, sid, digest in order:
        h.update(f"{ds}\t{sid}\t{digest}\n".encode("utf-8", "surrogatepass"))
    rows = [json.loads(line) for p in sorted((training_dir(tmp_path) / "shards").iterdir())
            for line in p.read_text(encoding="utf-8", errors="surrogatepass").splitlines()]
    assert [(r["dataset"], r["id"]) for r in rows] == [(ds, sid) for ds, sid, _ in order]
    assert tset.collisions == collisions and len(collisions) > 100
    assert tset.fingerprint == h.hexdigest()


def test_id_order_sorts_as_python_sorts_number_and_str() -> None:
    rng = random.Random(1)
    ids = sample_ids(rng, 3000) + [LONG * 3 + "b", LONG * 3 + "a", LONG * 3, "\U0001f600", ""]
    rng.shuffle(ids)
    primary = np.array([rng.choice([0.0, 1.5, -0.0, 2.0]) for _ in ids])
    column = Ids()
    for sid in ids:
        column.add(sid)
    order = id_order(primary, column, np.arange(len(ids)))
    assert order.tolist() == sorted(range(len(ids)), key=lambda i: (primary[i], ids[i]))


@pytest.mark.parametrize("n", [0, 1, 2, 17, 5000])
def test_shuffle_order_is_random_shuffle_of_a_list(n: int) -> None:
    for seed in (0, 42):
        items = list(range(n))
        random.Random(seed).shuffle(items)
        assert shuffle_order(n, seed).tolist() == items


class Monitor:
    """Redis's own record of the commands it served (MONITOR), on a connection of its own."""

    def __init__(self, url: str):
        self.client = redis.Redis.from_url(url)
        self.commands: list[str] = []
        self._monitor = self.client.monitor().__enter__()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            command = self._monitor.next_command()["command"]
            if command == "ECHO monitor-end":
                return
            self.commands.append(command)

    def stop(self) -> list[str]:
        self.client.echo("monitor-end")
        self._thread.join(timeout=60)
        assert not self._thread.is_alive()
        return self.commands


def test_rebuild_writes_the_done_map_to_redis_in_bounded_batches(
        tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: 1,050 samples on disk, and batches of at most 100 fields
    monkeypatch.setattr(recovery, "REDIS_BATCH", 100)
    folder = records_dir(tmp_path, "B1")
    folder.mkdir(parents=True)
    for w in range(3):
        with open(folder / f"w{w}.jsonl", "w", encoding="utf-8") as fh:
            for i in range(w, 1050, 3):
                fh.write(compact({"id": f"s{i}", "rid": f"r{i}", "time": i, "prompt_ids": [1],
                                  "output_ids": [2, 3], "completion_tokens": 2}))
    ledger = Ledger(connect(redis_url), Settings(redis_url=redis_url, output_dir=str(tmp_path),
                                                 token_budget=10**9))
    ledger.add_pending("B1", {f"s{i}": "{}" for i in range(1050)})
    monitor = Monitor(redis_url)

    rebuild_dataset(ledger, "B1")

    # Then: Redis saw the done fields, and the pending ids dropped, 100 at most per command
    commands = monitor.stop()
    done_key, pending_key = ledger.k("B1", keys.DONE_REBUILD), ledger.k("B1", keys.PENDING)
    def ids(command: str, key: str) -> int | None:  # sample ids in one command on key
        name, on, *args = command.split()  # (a done value "rid tokens" splits in two)
        return sum(a.startswith("s") for a in args) if on == key else None

    hsets = [n for c in commands if c.startswith("HSET") and (n := ids(c, done_key))]
    hdels = [n for c in commands if c.startswith("HDEL") and (n := ids(c, pending_key))]
    assert hsets == [100] * 10 + [50] and hdels == [100] * 10 + [50]
    assert len(ledger.committed("B1")) == 1050 and not ledger.pending_ids("B1")
