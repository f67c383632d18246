"""The training set: every dataset's records, filtered, deduplicated, shuffled and sharded.

``datagen prepare`` merges each dataset (``merge.merge_dataset``), then writes::

    <output_dir>/training/shards/shard_00000.jsonl  {"idx","id","dataset","prompt_ids","output_ids"}
    <output_dir>/training/specforge_prompts.jsonl   {"id","dataset","input_ids","loss_mask"} (exact)
    <output_dir>/training/conversations.jsonl       {"id","conversations","tools"?} (text_rows.py)
    <output_dir>/training/manifest.json             counts, tokens, seed, shards with sha256

Rules, in order: records without token ids are dropped (old format); truncated responses are
dropped when ``keep_truncated`` is off, unless the row reaches train_max_length (the cut lost
nothing that trains: ``window.cut_at_window``); an id already taken by an earlier dataset
(datasets in name order) is a collision and the later copy is dropped; what is left is sorted by
(dataset, id), shuffled with ``shuffle_seed`` and numbered ``idx`` 0..N-1. The same records and
settings give byte-identical files. Only an index is held in memory, in flat columns
(``sample_table``: dataset, offset, token counts and id, ~40 bytes a sample and its id; the
line digests wait in a temporary file); records are read back one at a time when the shards
are written. The conversations are written in a second pass, after the index is freed: the
tokenizer that decodes them brings transformers and torch (~250 MB), and the two never share
the memory.

Extraction names its output files by ``idx`` and resumes by (dataset, id), so a training set
must not change under a started extraction: ``prepare`` refuses when the new set differs from
the one extraction started on, unless forced.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import numpy as np

from config.settings import Settings
from datagen.errors import PermanentError
from datagen.generation.columns import each, frozen, id_order
from datagen.generation.committed import Committed
from datagen.generation.merge import datasets_on_disk, merge_dataset
from datagen.generation.records import (
    atomic_file,
    is_current,
    loss_spans,
    merged_path,
    write_atomic,
)
from datagen.generation.window import cut_at_window
from datagen.operations.progress import Progress
from datagen.servers import capture
from datagen.training import handoff
from datagen.training.sample_table import Entry, SampleTable, drop_collisions, shuffle_order
from datagen.training.text_rows import TextRows

log = logging.getLogger(__name__)

TRAINING_DIR = "training"
SHARDS_DIR = "shards"
HIDDEN_STATES_DIR = "hidden_states"
MANIFEST_NAME = "manifest.json"
CONVERSATIONS_NAME = "conversations.jsonl"
MANIFEST_VERSION = 1

LoadRows = Callable[[], TextRows]  # loads the tokenizer, returns the text rows' writer
PLACE = struct.Struct("<HQ")  # a written sample's (dataset number, offset), for the second pass


class TrainingSetChanged(PermanentError):
    """The records changed after extraction started on the previous training set."""


def training_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / TRAINING_DIR


def extraction_dir(settings: Settings) -> Path:
    return Path(settings.extraction_dir or training_dir(settings.output_dir) / HIDDEN_STATES_DIR)


def shard_relpath(number: int) -> str:
    """A shard's path relative to the output folder (what a `gpu` task message carries)."""
    return f"{TRAINING_DIR}/{SHARDS_DIR}/shard_{number:05d}.jsonl"


@dataclass
class DatasetCount:
    dataset: str
    records: int = 0            # in raw_responses.jsonl (one per id)
    uncommitted: int = 0        # written but never counted by the ledger: left out by merge
    copies: int = 0             # same id written twice (redelivery): merge kept one
    no_ids: int = 0             # old records without token ids
    truncated_dropped: int = 0  # truncated responses, dropped because keep_truncated is off
    empty: int = 0              # no response token: nothing to train on
    collisions: int = 0         # id already taken by an earlier dataset
    samples: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass
class TrainingSet:
    datasets: list[DatasetCount]
    collisions: list[tuple[str, str, str]]  # (id, kept in dataset, dropped from dataset)
    shards: list[dict[str, Any]] = field(default_factory=list)
    fingerprint: str = ""
    conversations: str | None = None
    text_rows: dict[str, int] = field(default_factory=dict)  # exact / inexact (text_rows.py)
    online_rows: str | None = None
    lengths: dict[str, handoff.LengthCount] = field(default_factory=dict)
    directory: str = ""

    @property
    def samples(self) -> int:
        return sum(d.samples for d in self.datasets)

    @property
    def tokens(self) -> int:
        return sum(d.tokens for d in self.datasets)


def prepare(settings: Settings,
            committed: Mapping[str, Mapping[str, str] | Committed | None],
            load_rows: LoadRows | None, force: bool = False) -> TrainingSet:
    """Merge, filter, deduplicate, shuffle and write the shards, conversations and manifest.

    ``committed``: per dataset the ledger's done map (None when Redis is not reachable: every
    record on disk counts), asked for one dataset at a time. ``load_rows``: loads the
    tokenizer and returns the text rows' writer (``text_rows.TextRows``), called once the
    shards are written; None skips the conversations."""
    out = Path(settings.output_dir)
    folder = training_dir(out)
    tset = TrainingSet([], [], directory=str(folder))
    rows_path = folder / handoff.ONLINE_ROWS_NAME
    with (_index(settings, committed, folder) as (counts, table, collisions),
          tempfile.TemporaryFile(prefix=".places-", dir=folder) as places):
        tset.datasets, tset.collisions = counts, collisions
        order = _shuffled(table, settings.shuffle_seed)
        tset.fingerprint = _fingerprint(table, order, settings)
        _check_unchanged(settings, tset.fingerprint, force)
        # One read of each record writes its shard line and its online row, and counts what
        # the length rule does to it; where it was is kept for the conversations' pass.
        with _Reader(out) as reader, atomic_file(rows_path) as rows:
            besides = _Besides(settings, tset.lengths, rows, places, table.datasets)
            tset.shards = _write_shards(out, table, order, settings.shard_samples, reader,
                                        besides)
        tset.online_rows = str(rows_path)
        del order
        names = table.datasets
        table.free()
        if load_rows is not None:
            rows_writer = load_rows()
            tset.conversations = str(_write_conversations(out, names, places, rows_writer))
            tset.text_rows = {"exact": rows_writer.exact, "inexact": rows_writer.inexact}
    _write_manifest(folder, tset, settings)
    return tset


@dataclass
class _Besides:
    """What a record gives besides its shard line, from the same read: the length rule's
    count, the online row, and where the record is (for the conversations' pass)."""

    settings: Settings
    lengths: dict[str, handoff.LengthCount]
    rows: TextIO
    places: BinaryIO
    datasets: list[str]

    def __post_init__(self) -> None:
        self._number = {name: i for i, name in enumerate(self.datasets)}

    def __call__(self, entry: Entry, record: dict[str, Any]) -> None:
        limit, overlong = self.settings.train_max_length, self.settings.extract_overlong
        spans = tuple(tuple(span) for span in loss_spans(record) or ())
        self.lengths.setdefault(entry.dataset, handoff.LengthCount()).add(
            entry.prompt_tokens, entry.prompt_tokens + entry.output_tokens, limit, overlong,
            spans)
        if row := handoff.online_row(record, limit, overlong, spans):
            self.rows.write(row)
        self.places.write(PLACE.pack(self._number[entry.dataset], entry.offset))


def _write_conversations(out: Path, datasets: list[str], places: BinaryIO,
                         rows: TextRows) -> Path:
    """conversations.jsonl in shard order: each record read again where the shard pass
    found it."""
    path = training_dir(out) / CONVERSATIONS_NAME
    places.flush()
    progress = Progress("prepare: conversations", places.tell() // PLACE.size, "samples")
    places.seek(0)
    with _Reader(out) as reader, atomic_file(path) as conversations:
        while chunk := places.read(PLACE.size * 65_536):
            for number, offset in PLACE.iter_unpack(chunk):
                record = reader.read(datasets[number], offset)
                conversations.write(rows.line(record))
            progress.update(len(chunk) // PLACE.size)
    progress.close()
    return path


@contextmanager
def _index(settings: Settings, committed: Mapping[str, Mapping[str, str] | Committed | None],
           spill_dir: Path
           ) -> Iterator[tuple[list[DatasetCount], SampleTable, list[tuple[str, str, str]]]]:
    counts: list[DatasetCount] = []
    with SampleTable(spill_dir) as table:
        for number, dataset in enumerate(datasets_on_disk(settings.output_dir)):
            merged = merge_dataset(settings.output_dir, dataset, committed.get(dataset))
            count = DatasetCount(dataset, records=merged.records,
                                 uncommitted=merged.uncommitted, copies=merged.duplicates)
            table.datasets.append(dataset)
            for offset, (record, digest) in _scan(merged_path(settings.output_dir, dataset)):
                entry = _admit(record, offset, count, settings.keep_truncated,
                               settings.train_max_length)
                if entry is None:
                    continue
                count.samples += 1
                count.prompt_tokens += entry.prompt_tokens
                count.output_tokens += entry.output_tokens
                table.add(number, entry, digest)
            counts.append(count)
        collisions = drop_collisions(table, counts)
        yield counts, table, collisions


def _scan(path: Path) -> Iterator[tuple[int, tuple[dict[str, Any], bytes]]]:
    """(byte offset, (record, sha256 of its line)) of every record of a merged file."""
    with open(path, "rb") as fh:
        offset = 0
        for raw in fh:
            if raw.strip():
                yield offset, (json.loads(raw), hashlib.sha256(raw).digest())
            offset += len(raw)


def _admit(record: dict[str, Any], offset: int, count: DatasetCount,
           keep_truncated: bool, window: int) -> Entry | None:
    if not is_current(record):
        count.no_ids += 1
        return None
    if record.get("truncated") and not keep_truncated and not cut_at_window(
            len(record["prompt_ids"]) + len(record["output_ids"]), window):
        count.truncated_dropped += 1
        return None
    if not record["output_ids"]:
        count.empty += 1
        return None
    return Entry(count.dataset, str(record["id"]), offset, len(record["prompt_ids"]),
                 len(record["output_ids"]))


def _shuffled(table: SampleTable, seed: int) -> np.ndarray:
    """The kept rows sorted by (dataset, id), then shuffled as ``random.Random(seed).shuffle``
    shuffles a list of them."""
    # sorted first: the order does not depend on merge order or on the datasets' listing
    rows = id_order(frozen(table.dataset, np.uint16).astype(np.int64), table.ids, table.kept)
    return rows[shuffle_order(len(rows), seed)]


def _fingerprint(table: SampleTable, order: np.ndarray, settings: Settings) -> str:
    h = hashlib.sha256(f"v{MANIFEST_VERSION} shard_samples={settings.shard_samples}\n".encode())
    names = [name.encode() for name in table.datasets]
    for row in each(order):
        h.update(b"%s\t%s\t%s\n" % (names[table.dataset[row]], table.ids.raw(row),
                                     table.digest(row).hex().encode()))
    return h.hexdigest()


def _check_unchanged(settings: Settings, fingerprint: str, force: bool) -> None:
    """Refuse a new set while extraction started on another: its rows are named by idx. With
    ``force``, go on, unless rows of that folder hold the only copy of captured states."""
    folder, extracted = training_dir(settings.output_dir), extraction_dir(settings)
    old = read_manifest(folder) if (folder / MANIFEST_NAME).is_file() else None
    if old is None or old.get("fingerprint") == fingerprint:
        return
    started = any(p.stat().st_size for p in (extracted / "manifest").glob("*.jsonl"))
    if not started:
        return
    msg = (f"the training set changed since extraction started in {extracted}: its files are "
           "named by idx, so new shards would overwrite them. ")
    only = capture.only_copies(settings.output_dir, extracted)
    if only:
        raise TrainingSetChanged(msg + _only_copies_advice(extracted, only, force))
    msg += (f"Finish extraction on the old set, or remove {extracted} (or pass --force and "
            "remove it yourself)")
    if not force:
        raise TrainingSetChanged(msg)
    log.warning("forced: %s", msg)


def _only_copies_advice(extracted: Path, only: list[tuple[Path, str]], force: bool) -> str:
    """What to do when rows of ``extracted`` hold the only copy of captured states: never
    remove the folder (with ``force`` too: the new set would lead there)."""
    aside = extracted.with_name(f"{extracted.name}.previous")
    mark, row = only[0]
    return (f"{len(only)} of its rows hold the only copy of their samples' captured states "
            f"(keep_captured_states = false freed the files the build read: e.g. {mark.name} "
            f"went into {extracted / row}), so removing {extracted} loses them for good"
            f"{' and --force does not lead there' if force else ''}. Finish extraction on "
            f"the old set; or keep those rows: move the folder aside (mv {extracted} {aside}; "
            f"SpecForge trains on it as it is) and prepare again; a new extraction builds "
            f"those samples only if they are generated again (or kept with "
            f"keep_captured_states = true before the next build)")


class _Reader:
    """Reads records back by (dataset, offset), one open file per dataset."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self._files: dict[str, BinaryIO] = {}

    def read(self, dataset: str, offset: int) -> dict[str, Any]:
        fh = self._files.get(dataset)
        if fh is None:
            fh = self._files[dataset] = open(  # noqa: SIM115 (closed in __exit__)
                merged_path(self.output_dir, dataset), "rb")
        fh.seek(offset)
        return json.loads(fh.readline())

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        for fh in self._files.values():
            fh.close()


def _write_shards(out: Path, table: SampleTable, order: np.ndarray, per_shard: int, reader: _Reader,
                  besides: Callable[[Entry, dict[str, Any]], None]) -> list[dict[str, Any]]:
    shards = []
    progress = Progress("prepare: shards", len(order), "samples")
    for number, start in enumerate(range(0, len(order), per_shard)):
        chunk = order[start:start + per_shard]
        rel = shard_relpath(number)
        digest = hashlib.sha256()
        lines = (_shard_line(start + i, _read(reader, table.entry(row), besides), digest, out)
                 for i, row in enumerate(chunk.tolist()))
        write_atomic(out / rel, lines)
        shards.append({"path": rel, "first_idx": start, "samples": len(chunk),
                       "tokens": table.tokens(chunk), "sha256": digest.hexdigest()})
        progress.update(len(chunk))
    progress.close()
    keep = {Path(s["path"]).name for s in shards}
    for stale in (out / TRAINING_DIR / SHARDS_DIR).glob("shard_*.jsonl"):
        if stale.name not in keep:  # a previous, larger training set
            stale.unlink()
    return shards


def _read(reader: _Reader, entry: Entry, besides: Callable[[Entry, dict[str, Any]], None]
          ) -> dict[str, Any]:
    record = reader.read(entry.dataset, entry.offset)
    besides(entry, record)
    return record


def _shard_line(idx: int, record: dict[str, Any], digest: Any, out: Path) -> str:
    row = {"idx": idx, "id": str(record["id"]), "dataset": record["dataset"],
           "prompt_ids": record["prompt_ids"], "output_ids": record["output_ids"]}
    spans = loss_spans(record)
    if spans is not None:  # several generated turns: the loss covers each of them
        row["loss_spans"] = spans
    if record.get("states"):  # captured in the generation pass (capture_states)
        # relative to output_dir, as the record has it: each gpu worker resolves it against
        # its own output_dir (a host may mount the shared folder elsewhere)
        row["states"] = record["states"]
    if record.get("output_logprobs"):  # check_states: what extraction checks the states by
        row["output_logprobs"] = record["output_logprobs"]
    if record.get("prompt_logprobs"):  # check_prompt_states: the prompt's positions too
        row["prompt_logprobs"] = record["prompt_logprobs"]
    line = json.dumps(row, separators=(",", ":"), ensure_ascii=False) + "\n"
    digest.update(line.encode("utf-8"))
    return line


def _write_manifest(folder: Path, tset: TrainingSet, settings: Settings) -> None:
    manifest = {
        "version": MANIFEST_VERSION,
        "fingerprint": tset.fingerprint,
        "shuffle_seed": settings.shuffle_seed,
        "shard_samples": settings.shard_samples,
        "keep_truncated": settings.keep_truncated,
        "samples": tset.samples,
        "tokens": tset.tokens,
        "datasets": {d.dataset: {**asdict(d), "tokens": d.tokens} for d in tset.datasets},
        "collisions": [{"id": i, "kept": a, "dropped": b} for i, a, b in tset.collisions],
        "conversations": CONVERSATIONS_NAME if tset.conversations else None,
        "text_rows": tset.text_rows,
        "online_rows": handoff.ONLINE_ROWS_NAME,
        "length_rule": {"train_max_length": settings.train_max_length,
                        "overlong": settings.extract_overlong,
                        "datasets": {ds: asdict(c) for ds, c in tset.lengths.items()}},
        "shards": tset.shards,
    }
    write_atomic(folder / MANIFEST_NAME, iter([json.dumps(manifest, indent=2) + "\n"]))


def read_manifest(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST_NAME
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise PermanentError(f"no training set at {path}: run `datagen prepare` first") from exc


def render(tset: TrainingSet) -> str:
    """The per-dataset table `datagen prepare` prints."""
    head = (f"{'dataset':<16}{'records':>9}{'trunc.':>8}{'dup id':>8}{'other':>7}"
            f"{'samples':>9}{'prompt tok':>13}{'output tok':>13}{'tokens':>13}")
    lines = [head]
    for d in tset.datasets:
        other = d.no_ids + d.empty
        lines.append(f"{d.dataset:<16}{d.records:>9,}{d.truncated_dropped:>8,}"
                     f"{d.collisions:>8,}{other:>7,}{d.samples:>9,}{d.prompt_tokens:>13,}"
                     f"{d.output_tokens:>13,}{d.tokens:>13,}")
    prompt = sum(d.prompt_tokens for d in tset.datasets)
    output = sum(d.output_tokens for d in tset.datasets)
    lines.append(f"{'total':<16}{sum(d.records for d in tset.datasets):>9,}"
                 f"{sum(d.truncated_dropped for d in tset.datasets):>8,}"
                 f"{len(tset.collisions):>8,}"
                 f"{sum(d.no_ids + d.empty for d in tset.datasets):>7,}{tset.samples:>9,}"
                 f"{prompt:>13,}{output:>13,}{tset.tokens:>13,}")
    for sid, kept, dropped in tset.collisions[:10]:
        lines.append(f"  id {sid!r} in {dropped} already taken by {kept}: dropped")
    if len(tset.collisions) > 10:
        lines.append(f"  ... {len(tset.collisions) - 10} more collisions in the manifest")
    copies = sum(d.copies for d in tset.datasets)
    if copies:
        lines.append(f"  {copies} duplicate copies of a record (redeliveries) merged into one")
    uncommitted = sum(d.uncommitted for d in tset.datasets)
    if uncommitted:
        lines.append(f"  {uncommitted} records never committed by the ledger left out")
    lines.append(f"{len(tset.shards)} shards of up to {_per(tset)} samples in "
                 f"{tset.directory}/{SHARDS_DIR}; manifest {MANIFEST_NAME}")
    lines += _length_lines(tset)
    lines.append(f"pre-tokenized rows (exact, for online training): {tset.online_rows}")
    exact = tset.text_rows.get("exact", 0)
    inexact = tset.text_rows.get("inexact", 0)
    lines.append(f"conversations (text, re-tokenized by the trainer; {exact:,} rebuild the ids "
                 f"exactly, {inexact:,} as decoded text): "
                 f"{tset.conversations or 'not written (no tokenizer)'}")
    return "\n".join(lines)


def _length_lines(tset: TrainingSet) -> list[str]:
    """What the train_max_length rule drops and cuts, per dataset that it touches."""
    lines = []
    for ds, c in sorted(tset.lengths.items()):
        if c.dropped or c.cut:
            lines.append(f"  {ds}: train_max_length drops {c.dropped:,} samples "
                         f"({c.dropped_tokens:,} tokens) and cuts {c.cut:,} "
                         f"({c.cut_tokens:,} tokens)")
    return lines


def _per(tset: TrainingSet) -> int:
    return max((s["samples"] for s in tset.shards), default=0)
