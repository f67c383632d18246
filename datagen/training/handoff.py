"""The folder SpecForge trains on: the length rule both phases share, the pre-tokenized online
rows, and at the end of extraction the vocab mapping, the draft config and the run config.

Checked against sgl-project/SpecForge at commit a6b6b02 (the single ``specforge train --config``
entry point; the old ``scripts/train_eagle3.py`` was removed there). Layout, in the extraction
folder (SpecForge's ``data.hidden_states_path``; its reader lists only ``*.ckpt``/``*.ckpt.gz``,
so the other files are invisible to it)::

    rows_*/data_<idx>.ckpt      the samples (gpu workers)
    vocab_counts/<shard>.json   token counts per shard (gpu workers, while writing the files)
    vocab_mapping.pt            {"d2t", "t2d"} (datagen extract, from the counts)
    draft_config.json           LlamaForCausalLMEagle3, aux ids as extracted
    specforge_train.json        the run config: `specforge train --config <this file>`
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datagen.generation.records import atomic_file
from datagen.generation.window import trainable
from datagen.training import draft_config as dc
from datagen.training import vocab_mapping as vm

DRAFT_CONFIG_NAME = "draft_config.json"
RUN_CONFIG_NAME = "specforge_train.json"
ONLINE_ROWS_NAME = "specforge_prompts.jsonl"  # in training/, next to conversations.jsonl
SPECFORGE_COMMIT = "a6b6b02"  # the SpecForge source this layout and command were checked on
TRAIN_DTYPE = "bfloat16"      # SpecForge trains in bf16; float32 files break its projection


# -- the length rule (datagen prepare reports it, extraction applies it) ---------------------

Spans = Sequence[Sequence[int]]  # [start, end) of each generated turn; () = one, after the prompt


def _spans(n_prompt: int, n_total: int, spans: Spans) -> Spans:
    return spans or ((n_prompt, n_total),)


def kept_length(n_prompt: int, n_total: int, max_length: int, overlong: str,
                spans: Spans = ()) -> tuple[int, str]:
    """(tokens kept, "") or (0, why the sample is dropped).

    SpecForge cuts every sample at ``data.max_length`` and zeroes the loss of its last
    position (nothing follows it), so a sample trains on something only when a loss position
    other than the last survives the cut."""
    if n_total > max_length and overlong == "skip":
        return 0, f"{n_total} tokens > train_max_length {max_length}"
    kept = min(n_total, max_length)
    if trainable(n_prompt, n_total, max_length, overlong, spans) < 1:
        return 0, (f"no trainable token within train_max_length {max_length} "
                   f"(prompt {n_prompt}, response {n_total - n_prompt} tokens)")
    return kept, ""


@dataclass
class LengthCount:
    """What the length rule does to one dataset."""

    dropped: int = 0          # samples left out: no trainable token within the limit
    dropped_tokens: int = 0   # all their tokens
    cut: int = 0              # samples truncated at the limit
    cut_tokens: int = 0       # tokens cut off their ends

    def add(self, n_prompt: int, n_total: int, max_length: int, overlong: str,
            spans: Spans = ()) -> int:
        kept, _ = kept_length(n_prompt, n_total, max_length, overlong, spans)
        if not kept:
            self.dropped += 1
            self.dropped_tokens += n_total
        elif kept < n_total:
            self.cut += 1
            self.cut_tokens += n_total - kept
        return kept


def loss_mask(n_prompt: int, length: int, spans: Spans = ()) -> list[int]:
    """1 on the generated tokens (each span's, or all after the prompt), cut at ``length``."""
    mask = [0] * length
    for a, b in _spans(n_prompt, length, spans):
        mask[a:min(b, length)] = [1] * max(0, min(b, length) - a)
    return mask


def online_row(record: dict[str, Any], max_length: int, overlong: str,
               spans: Spans = ()) -> str | None:
    """The pre-tokenized row SpecForge's online prompt builder takes as is
    (``data.prompts_path``): the same ``input_ids``/``loss_mask`` as the sample's .ckpt file,
    or None when the length rule drops the sample."""
    prompt, output = record["prompt_ids"], record["output_ids"]
    n_total = len(prompt) + len(output)
    kept, _ = kept_length(len(prompt), n_total, max_length, overlong, spans)
    if not kept:
        return None
    ids = (prompt + output)[:kept]
    return json.dumps({"id": str(record["id"]), "dataset": record["dataset"], "input_ids": ids,
                       "loss_mask": loss_mask(len(prompt), kept, spans)},
                      separators=(",", ":"), ensure_ascii=False) + "\n"


# -- the handoff, written once extraction is done --------------------------------------------

@dataclass(frozen=True)
class Handoff:
    folder: Path
    run_config: Path
    draft_config: Path
    vocab_mapping: Path
    draft_vocab_size: int
    target_vocab_size: int
    coverage: float           # share of the trained tokens inside the draft vocabulary
    aux_layer_ids: list[int]
    max_length: int
    dtype: str


def train_command(run_config: Path) -> str:
    return f"specforge train --config {run_config}"


def read_counts(folder: Path, shard_names: Iterable[str]) -> tuple[list[dict], list[dict]]:
    """Every shard's counts and what its worker recorded; one clear error for a missing file."""
    counts, metas = [], []
    for name in shard_names:
        path = folder / vm.COUNTS_DIR / f"{name}.json"
        if not path.is_file():
            raise ValueError(f"{path} is missing: shard {name} was extracted without token "
                             "counts (by an earlier version), so no vocab mapping can be "
                             "made from them")
        c, meta = vm.read_shard_counts(path)
        counts.append(c)
        metas.append({**meta, "file": str(path)})
    return counts, metas


def _agreed(metas: Sequence[dict], key: str) -> Any:
    values = {json.dumps(m.get(key)) for m in metas}
    if len(values) > 1:
        files = ", ".join(f"{m['file']}: {m.get(key)}" for m in metas[:4])
        raise ValueError(f"shards were extracted with different {key}: {files} ...")
    return metas[0].get(key) if metas else None


def write_handoff(folder: Path, shard_names: Sequence[str], model_path: str,
                  draft_vocab_size: int, train_max_length: int,
                  trust_remote_code: bool = False) -> Handoff:
    """vocab_mapping.pt, draft_config.json and specforge_train.json in ``folder``."""
    folder = folder.resolve()
    counts, metas = read_counts(folder, shard_names)
    aux = _agreed(metas, "aux_layer_ids")
    max_length = _agreed(metas, "max_length")
    dtype = _agreed(metas, "dtype")
    if max_length != train_max_length:
        raise ValueError(f"the files were extracted with train_max_length {max_length}, the "
                         f"settings say {train_max_length}: SpecForge must cut at the length "
                         "the files were written with")
    if not aux or len(aux) != 3:
        raise ValueError(f"aux_layer_ids {aux}: SpecForge's EAGLE-3 draft takes exactly three")
    target = dc.read_target_config(model_path)
    target_vocab = dc.target_vocab_size(target)
    draft_vocab = vm.effective_draft_vocab(draft_vocab_size, target_vocab)
    merged = vm.merge_counts(counts)
    d2t, t2d = vm.mappings(merged, draft_vocab, target_vocab)
    mapping = vm.save_mapping(folder / vm.MAPPING_NAME, d2t, t2d)
    draft = _write_json(folder / DRAFT_CONFIG_NAME,
                        dc.draft_config(target, aux, draft_vocab, TRAIN_DTYPE))
    run = _write_json(folder / RUN_CONFIG_NAME,
                      run_config(Path(model_path).resolve(), draft, mapping, folder, max_length,
                                 trust_remote_code))
    return Handoff(folder, run, draft, mapping, draft_vocab, target_vocab,
                   vm.coverage(merged, d2t), list(aux), max_length, str(dtype))


def run_config(model_path: Path, draft: Path, mapping: Path, features: Path, max_length: int,
               trust_remote_code: bool) -> dict[str, Any]:
    """SpecForge's typed run config (``specforge/config/schema.py``) for offline EAGLE-3."""
    return {
        "model": {"target_model_path": str(model_path), "draft_model_config": str(draft),
                  "vocab_mapping_path": str(mapping), "torch_dtype": TRAIN_DTYPE,
                  "trust_remote_code": trust_remote_code},
        "data": {"hidden_states_path": str(features), "max_length": max_length},
        "training": {"strategy": "eagle3"},
        "run_id": "datagen-eagle3",
        "output_dir": str(features.parent / "specforge_output"),
    }


def _write_json(path: Path, body: dict[str, Any]) -> Path:
    with atomic_file(path) as fh:
        fh.write(json.dumps(body, indent=2) + "\n")
    return path


def describe(h: Handoff) -> str:
    """What `datagen extract` prints at the end and `datagen status` repeats."""
    lines = [f"SpecForge handoff in {h.folder}:",
             f"  {RUN_CONFIG_NAME}  {DRAFT_CONFIG_NAME}  {vm.MAPPING_NAME} "
             f"(draft vocab {h.draft_vocab_size:,} of {h.target_vocab_size:,}, covering "
             f"{h.coverage:.1%} of the trained tokens), aux layers {h.aux_layer_ids}, "
             f"max_length {h.max_length}",
             f"  train: {train_command(h.run_config)}",
             "  (more GPUs: append deployment.trainer.nproc_per_node=8)"]
    if h.dtype != TRAIN_DTYPE:
        lines.append(f"  note: the files are {h.dtype}; SpecForge trains in {TRAIN_DTYPE} "
                     "(extract_dtype = \"bfloat16\" for files it trains on as they are)")
    return "\n".join(lines)


def existing(folder: Path) -> str | None:
    """The handoff lines for a folder that has one (for `datagen status`), else None."""
    run = folder / RUN_CONFIG_NAME
    if not run.is_file():
        return None
    try:
        body = json.loads(run.read_text(encoding="utf-8"))
        max_length = body["data"]["max_length"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"SpecForge handoff in {folder}: {run} is unreadable; `datagen extract` rewrites it"
    return (f"SpecForge handoff in {folder.resolve()} (max_length {max_length}):\n"
            f"  train: {train_command(run.resolve())}")
