"""The `captured` backend: SpecForge's files from the states the generation server captured
(``capture_states``), with no forward pass.

Each shard line names the file its committed record names, relative to the run's
``output_dir`` (``run_dir`` here: this host's mount of it) (datagen/servers/capture.py:
``input_ids`` [L], ``aux_hidden_state`` [L, 3H], ``hidden_state`` [L, H] post-norm, the last
output id never an input and so not in it, no position past the generation run's
``train_max_length``); files.prepare cut the sample to those ids and to
``train_max_length``. This backend reads the kept positions only (safetensors slices), checks
the ids, casts to ``extract_dtype`` and writes ``data_{idx}.ckpt`` through the Extractor's
atomic write, loss mask from the record's prompt/output split; the Extractor keeps everything
else (shards, resume, manifest, vocab counts, dead letters) as for the other backends. Files
no committed record names (an aborted, reaped or duplicate attempt's) are never read.

Once a sample's row is durable (its file fsynced and renamed, its manifest line written: what
resume trusts) the captured file is freed (``recorded``; ``keep_captured_states`` keeps it),
so the disk holds one copy of the states plus the shard in flight, not two. It leaves a mark
(capture.release) that keeps the record counted; a later build that needs the file again (a
changed training set) fails that sample with what to do, never silently.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from datagen.errors import PermanentError
from datagen.extraction.backends.base import set_shape, text_config
from datagen.extraction.files import Sample, sample_tensors, save_atomic
from datagen.servers import capture

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class StatesReleased(PermanentError):
    """The captured file was freed by an earlier build: its states are only in that row."""


class CapturedBackend:
    packs = False
    writes_files = True  # each file is written from its captured one; forward_row never runs

    def __init__(self, cfg: Any, device: torch.device):
        set_shape(self, text_config(cfg.model_path), cfg.aux_layer_ids, device)
        self.dtype = DTYPES[cfg.dtype]
        self.inflight = cfg.writer_threads
        self.run_dir = Path(cfg.run_dir or ".")
        self.keep = bool(getattr(cfg, "keep_captured_states", False))
        self.freed_bytes = 0  # by this process's builds (a count for benches and logs)

    def path(self, sample: Sample) -> Path:
        """The sample's file: the shard names it relative to the run's output_dir (an
        absolute name, as older shards have, is taken as it is)."""
        return self.run_dir / sample.states

    def forward_row(self, id_lists: Sequence[Sequence[int]], out: torch.Tensor) -> None:
        raise NotImplementedError("the captured backend runs no forward: Extractor uses extract()")

    def states(self, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [1, n, 3H], final [1, n, H]) of the sample's kept positions, checked."""
        from safetensors import safe_open

        n, path = sample.length, self.path(sample)
        row = None if path.is_file() else capture.built_row(path)
        if row is not None:
            raise StatesReleased(
                f"{path} was freed after the row {row} of an earlier build was written "
                "(keep_captured_states = false): finish extraction on that training set and "
                "keep its folder, or generate the sample again; set keep_captured_states = "
                "true before a build whose set may still change")
        with safe_open(str(path), framework="pt") as fh:
            aux_ids = json.loads((fh.metadata() or {}).get("aux_layer_ids", "null"))
            if aux_ids != list(self.aux_layer_ids):
                raise ValueError(f"{path.name}: captured at aux layers "
                                 f"{aux_ids}, extraction asks for {list(self.aux_layer_ids)}")
            ids = fh.get_slice("input_ids")[:n]
            aux = fh.get_slice("aux_hidden_state")[:n]
            final = fh.get_slice("hidden_state")[:n]
        if len(ids) < n:
            raise ValueError(
                f"{path.name}: {len(ids)} positions captured, the row needs {n}: the server "
                f"kept the window of the generation run (train_max_length {len(ids)} or less) "
                "and no position past it; a longer train_max_length needs the states "
                "extracted again (extract_backend hf, vllm or sglang)")
        if ids.tolist() != sample.input_ids:
            raise ValueError(f"{path.name}: its ids are not the record's")
        if aux.shape != (n, self.n_aux * self.hidden) or final.shape != (n, self.hidden):
            raise ValueError(f"{path.name}: aux {list(aux.shape)}, final "
                             f"{list(final.shape)}; expected {n} x {self.n_aux} x {self.hidden}")
        return aux.to(self.dtype).unsqueeze(0), final.unsqueeze(0)

    def extract(self, sample: Sample, mask: Sequence[int], path: Path,
                check: Callable[[torch.Tensor, torch.Tensor], Any] | None = None) -> int:
        """The sample's file; ``check`` (the state check) sees its aux [n, 3H] and final
        states [n, H] as captured, before anything is written."""
        aux, final = self.states(sample)
        if check is not None:
            check(aux[0], final[0])  # final in the dtype the server stored it in
        return save_atomic(path, sample_tensors(sample, aux, final.to(self.dtype)))

    def recorded(self, sample: Sample, row: str) -> None:
        """The sample's row is durable (file and manifest line): free its captured file."""
        if self.keep:
            return
        try:
            self.freed_bytes += capture.release(self.path(sample), row)
        except OSError as exc:  # the row is done all the same; the next run frees it
            log.warning("%s: not freed after its row %s was built: %s", self.path(sample),
                        row, exc)

    def close(self) -> None:
        pass


def create(cfg: Any, device: torch.device) -> CapturedBackend:
    return CapturedBackend(cfg, device)
