"""Files of the extraction phase: shard input, sample layout, atomic writes (manifest: manifest.py).

Output layout (SpecForge walks the folder recursively and keeps names ending in ``.ckpt``)::

    output_dir/rows_0-2000/data_17.ckpt
    output_dir/rows_0-2000/.data_18.ckpt.tmp-<pid>-<thread>   (in flight; never ends in .ckpt)
    output_dir/manifest/<shard-name>.jsonl                    ({idx, id, dataset, path, tokens})

Crash safety: a file is written under a temp name, fsynced, renamed, the folder fsynced, and
only then its manifest line appended. A sample counts as done when its manifest line exists
AND its file exists. A file renamed but not yet in the manifest (killed in between) is simply
rewritten on the next run: the rename is atomic, so the old and new file are both complete,
and redoing at most ``writer_threads`` samples is cheaper than loading each file to adopt it.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from datagen.generation.records import unpack_logprobs
from datagen.training.handoff import kept_length, loss_mask

ROWS_PER_DIR = 2000
TMP_MARK = ".tmp-"
_TMP_NAME = re.compile(r"^\.data_(\d+)\.[a-z]+" + re.escape(TMP_MARK))


@dataclass(frozen=True)
class Sample:
    idx: int
    id: str
    dataset: str
    input_ids: list[int]   # prompt + output, already cut by the length rule
    n_prompt: int          # leading tokens with loss_mask 0
    truncated: bool
    # Several generated turns (regenerate = "all"): [start, end) of each, loss_mask 1 there.
    loss_spans: tuple[tuple[int, int], ...] = ()
    states: str = ""  # the file captured in the generation pass (extract_backend "captured")
    # captured: the last output id when the same sample's `hf` row keeps it (its stop token,
    # never an input of the generation pass, so not in input_ids): counted for the vocab
    uncaptured: tuple[int, ...] = ()
    # the generation server's log-probability of output id i, given the ids before it
    # (the record's output_logprobs, check_states): what the final state at position
    # n_prompt - 1 + i must give (datagen/extraction/integrity.py)
    logprobs: tuple[float, ...] = ()
    # the same of prompt id j + 1, j = 0 .. len(prompt_ids) - 2 (the record's prompt_logprobs,
    # check_prompt_states): what the final state at position j must give
    prompt_logprobs: tuple[float, ...] = ()

    @property
    def length(self) -> int:
        return len(self.input_ids)

    @property
    def key(self) -> tuple[str, str]:
        # ids are unique per dataset, not necessarily across datasets
        return (self.dataset, self.id)


@dataclass(frozen=True)
class Rejected:
    idx: int | None
    id: str
    reason: str
    overlong: bool = False


def read_shard(path: str | Path) -> list[tuple[int, Any]]:
    """(line number, parsed record or the JSON error) for every non-blank line."""
    out: list[tuple[int, Any]] = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append((n, json.loads(line)))
            except json.JSONDecodeError as exc:
                out.append((n, exc))
    return out


def _ids_ok(ids: Any, vocab_size: int) -> bool:
    return isinstance(ids, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids)


def prepare(line: int, rec: Any, max_length: int, overlong: str,
            vocab_size: int, captured: bool = False) -> Sample | Rejected:
    """Validate one record and apply the length rule (datagen/training/handoff.py, the one
    SpecForge's data.max_length agrees with); ids out of the vocab are rejected
    here because on CUDA they would trip a device-side assert that poisons the whole process.
    ``captured``: the states come from the generation pass, which never ran the last output
    id (nothing followed it), so the sample ends one id earlier. SpecForge trains position t
    (loss mask 1, the last position zeroed) towards lm_head(final state of t + 1): the
    prediction of the stop token (final state of the id before it) is trained in both rows,
    and only the `hf` row's last trained position, what follows the stop token, is not
    here. The stop token is still counted for the draft vocabulary (``uncaptured``), as
    for the `hf` row: outside it, the drafter could never propose the end of a turn."""
    if not isinstance(rec, dict):
        return Rejected(None, f"line {line}", f"not a JSON object: {rec}")
    idx, sid = rec.get("idx"), str(rec.get("id", f"line {line}"))
    if not isinstance(idx, int) or idx < 0:
        return Rejected(None, sid, f"line {line}: bad idx {idx!r}")
    prompt, output = rec.get("prompt_ids"), rec.get("output_ids")
    if not (_ids_ok(prompt, vocab_size) and _ids_ok(output, vocab_size)):
        return Rejected(idx, sid, f"token ids missing, not ints or outside [0, {vocab_size})")
    full = prompt + output
    if captured:
        if not isinstance(rec.get("states"), str) or rec.get("loss_spans") is not None:
            return Rejected(idx, sid, "no captured states named (the record was generated "
                                      "without capture_states)")
        output = output[:-1]
    ids = prompt + output
    if not ids:
        return Rejected(idx, sid, "no tokens")
    spans = _loss_spans(rec.get("loss_spans"), len(prompt), len(ids))
    if spans is None:
        return Rejected(idx, sid, "loss_spans not ordered [start, end) pairs inside the ids")
    logprobs = _logprobs(rec.get("output_logprobs"), len(rec["output_ids"]))
    if logprobs is None:
        return Rejected(idx, sid, "output_logprobs is not one float32 per output id")
    prompt_logprobs = _logprobs(rec.get("prompt_logprobs"), max(0, len(prompt) - 1))
    if prompt_logprobs is None:
        return Rejected(idx, sid, "prompt_logprobs is not one float32 per prompt id after "
                                  "the first")
    first = spans[0][0] if spans else len(prompt)
    kept, why = kept_length(first, len(ids), max_length, overlong, spans)
    if not kept:
        return Rejected(idx, sid, why, overlong=True)
    if not captured:
        return Sample(idx, sid, str(rec.get("dataset", "")), ids[:kept], first,
                      kept < len(ids), spans, logprobs=logprobs,
                      prompt_logprobs=prompt_logprobs)
    as_hf, _ = kept_length(first, len(full), max_length, overlong, spans)
    return Sample(idx, sid, str(rec.get("dataset", "")), ids[:kept], first, kept < len(ids),
                  spans, rec["states"], tuple(full[kept:as_hf]), logprobs, prompt_logprobs)


def _logprobs(raw: Any, n_output: int) -> tuple[float, ...] | None:
    """A record's output_logprobs or prompt_logprobs (() when it has none), or None when
    malformed."""
    if raw is None:
        return ()
    try:
        values = unpack_logprobs(raw)
    except (TypeError, ValueError):
        return None
    return tuple(values) if len(values) == n_output else None


def _loss_spans(raw: Any, n_prompt: int, n_ids: int) -> tuple[tuple[int, int], ...] | None:
    """A multi-turn record's spans (), or None when they are malformed."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        return None
    spans, end = [], 0
    for span in raw:
        if not (isinstance(span, list) and len(span) == 2 and all(type(x) is int for x in span)
                and end <= span[0] <= span[1] <= n_ids):
            return None
        spans.append((span[0], span[1]))
        end = span[1]
    return tuple(spans) if spans[-1] == (n_prompt, n_ids) else None


def rows_dir(idx: int) -> str:
    start = idx // ROWS_PER_DIR * ROWS_PER_DIR
    return f"rows_{start}-{start + ROWS_PER_DIR}"


def relative_path(idx: int) -> str:
    return f"{rows_dir(idx)}/data_{idx}.ckpt"


def sample_tensors(sample: Sample, aux: torch.Tensor, final: torch.Tensor) -> dict:
    ids = torch.tensor(sample.input_ids, dtype=torch.int64)
    mask = torch.tensor(sample_loss_mask(sample), dtype=torch.int64)
    return {"input_ids": ids, "loss_mask": mask, "aux_hidden_state": aux, "hidden_state": final}


def sample_loss_mask(sample: Sample) -> list[int]:
    """The file's loss_mask (also what the vocab counts and the online rows use)."""
    return loss_mask(sample.n_prompt, sample.length, sample.loss_spans)


def counted_ids(sample: Sample) -> tuple[list[int], list[int]]:
    """(ids, loss mask) the draft vocabulary counts: the file's, and a captured sample's
    stop token where its `hf` row has it (after the prompt: loss 1)."""
    tail = list(sample.uncaptured)
    return sample.input_ids + tail, sample_loss_mask(sample) + [1] * len(tail)


def _fsync(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomic(final: Path, tensors: dict[str, torch.Tensor],
                save: Callable[[dict[str, torch.Tensor], Path], Any] = torch.save) -> int:
    """Write (``save``: torch.save, or safetensors' save_file for captured states), fsync,
    rename, fsync the folder; returns the file size."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}{TMP_MARK}{os.getpid()}-{threading.get_ident()}"
    try:
        save(tensors, tmp)
        size = tmp.stat().st_size
        _fsync(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(final.parent)  # makes the rename itself durable before the manifest names the file
    return size


def remove_stale_temps(output_dir: Path, idxs: Iterable[int]) -> int:
    """Delete temp files a killed run left for these samples (only these: other workers may be
    writing their own samples into the same rows_ folder right now)."""
    by_dir: dict[str, set[int]] = {}
    for idx in idxs:
        by_dir.setdefault(rows_dir(idx), set()).add(idx)
    removed = 0
    for sub, wanted in by_dir.items():
        folder = output_dir / sub
        if not folder.is_dir():
            continue
        for entry in os.scandir(folder):
            m = _TMP_NAME.match(entry.name)
            if m and int(m.group(1)) in wanted:
                Path(entry.path).unlink(missing_ok=True)
                removed += 1
    return removed
