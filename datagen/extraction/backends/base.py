"""The one small interface every extraction backend implements.

A backend owns the target model on this rank and runs one *row*: the token ids of one or more
consecutive samples, concatenated, into ``out`` [tokens, (n_aux + 1) * hidden] (the aux layer
outputs in ``aux_layer_ids`` order, then the final post-norm state). Everything else (reading
shards, batching, packing decisions, staging, files) is the Extractor's and the same for all.

    hf       transformers on one device                        (backends/hf.py)
    hf-tp    transformers tensor parallelism over the replica  (backends/hf_tp.py)
    sglang   SGLang's model runner through SpecForge's capture (backends/sglang.py)
    vllm     a vLLM engine whose connector writes the files itself (backends/vllm.py):
             ``writes_files`` is True, ``extract(ids, loss_mask, path)`` replaces forward_row
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


class Backend(Protocol):
    hidden: int                      # hidden size H
    n_aux: int                       # aux layers stored per token
    width: int                       # (n_aux + 1) * H values per token
    vocab_size: int
    num_layers: int                  # decoder layers of the target
    aux_layer_ids: tuple[int, ...]
    device: Any                      # torch.device the row's output lives on
    packs: bool                      # several samples per row (position ids restart at 0)

    def forward_row(self, id_lists: Sequence[Sequence[int]], out: Any) -> None: ...

    def close(self) -> None: ...


def text_config(model_path: str) -> dict[str, Any]:
    """The language model's config.json entries (multimodal checkpoints nest them)."""
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    return config.get("text_config", config)


def set_shape(backend: Any, config: dict[str, Any], aux_ids: Sequence[int] | None,
              device: Any) -> None:
    """A backend's shape attributes from the text config; aux ids default to SpecForge's."""
    from datagen.extraction.estimate import default_aux_layer_ids

    backend.hidden = int(config["hidden_size"])
    backend.num_layers = int(config["num_hidden_layers"])
    backend.vocab_size = int(config["vocab_size"])
    backend.aux_layer_ids = tuple(aux_ids or default_aux_layer_ids(backend.num_layers))
    if any(not 0 <= i < backend.num_layers for i in backend.aux_layer_ids):
        raise ValueError(f"aux_layer_ids {list(backend.aux_layer_ids)} outside "
                         f"[0, {backend.num_layers}) decoder layers")
    backend.n_aux = len(backend.aux_layer_ids)
    backend.width = (backend.n_aux + 1) * backend.hidden
    backend.device = device
