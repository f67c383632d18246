"""The `captured` backend: SpecForge's files from the states the generation server captured
(``capture_states``), with no forward pass.

Each shard line names the file its committed record names, relative to the run's
``output_dir`` (``run_dir`` here: this host's mount of it) (datagen/servers/capture.py:
``input_ids`` [L], ``aux_hidden_state`` [L, 3H], ``hidden_state`` [L, H] post-norm, the last
output id never an input and so not in it); files.prepare cut the sample to those ids and to
``train_max_length``. This backend reads the kept positions only (safetensors slices), checks
the ids, casts to ``extract_dtype`` and writes ``data_{idx}.ckpt`` through the Extractor's
atomic write, loss mask from the record's prompt/output split; the Extractor keeps everything
else (shards, resume, manifest, vocab counts, dead letters) as for the other backends. Files
no committed record names (an aborted, reaped or duplicate attempt's) are never read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from datagen.extraction.backends.base import set_shape, text_config
from datagen.extraction.files import Sample, sample_tensors, save_atomic

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class CapturedBackend:
    packs = False
    writes_files = True  # each file is written from its captured one; forward_row never runs

    def __init__(self, cfg: Any, device: torch.device):
        set_shape(self, text_config(cfg.model_path), cfg.aux_layer_ids, device)
        self.dtype = DTYPES[cfg.dtype]
        self.inflight = cfg.writer_threads
        self.run_dir = Path(cfg.run_dir or ".")

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
        with safe_open(str(path), framework="pt") as fh:
            aux_ids = json.loads((fh.metadata() or {}).get("aux_layer_ids", "null"))
            if aux_ids != list(self.aux_layer_ids):
                raise ValueError(f"{path.name}: captured at aux layers "
                                 f"{aux_ids}, extraction asks for {list(self.aux_layer_ids)}")
            ids = fh.get_slice("input_ids")[:n]
            aux = fh.get_slice("aux_hidden_state")[:n]
            final = fh.get_slice("hidden_state")[:n]
        if ids.tolist() != sample.input_ids:
            raise ValueError(f"{path.name}: its ids are not the record's")
        if aux.shape != (n, self.n_aux * self.hidden) or final.shape != (n, self.hidden):
            raise ValueError(f"{path.name}: aux {list(aux.shape)}, final "
                             f"{list(final.shape)}; expected {n} x {self.n_aux} x {self.hidden}")
        return aux.to(self.dtype).unsqueeze(0), final.unsqueeze(0)

    def extract(self, sample: Sample, mask: Sequence[int], path: Path,
                check: Callable[[torch.Tensor], Any] | None = None) -> int:
        """The sample's file; ``check`` (the state check) sees its final states [n, H] as
        captured, before anything is written."""
        aux, final = self.states(sample)
        if check is not None:
            check(final[0])  # in the dtype the server ran (its rounding is what is allowed)
        return save_atomic(path, sample_tensors(sample, aux, final.to(self.dtype)))

    def close(self) -> None:
        pass


def create(cfg: Any, device: torch.device) -> CapturedBackend:
    return CapturedBackend(cfg, device)
