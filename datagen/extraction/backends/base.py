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

from collections.abc import Sequence
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
