"""The `sglang` backend: SGLang's own model runner, tensor-parallel over the replica's ranks,
capturing the aux layers inside the engine, through SpecForge's offline capture.

For checkpoints transformers cannot run on a node: Kimi-K2.5's INT4 compressed-tensors
weights, which transformers dequantizes to bf16 (~2 TB). SpecForge (``specforge.offline_capture``
at commit a6b6b02) builds an SGLang ``ModelRunner`` in each rank of its TP group, sets the
capture layers with the model's own ``set_eagle3_layers_to_capture`` (SGLang implements it for
llama, qwen3, qwen3_moe, deepseek_v2/v3 and kimi_k25) and runs one extend (prefill) forward per
call, returning per request the aux states [L, 3H] and the final post-norm states [L, H].

    load_offline_capture(path, torch_dtype=, trust_remote_code=)   # tp_size: the TP group's
    capture.set_capture_layers(ids)                                # outputs of layers ids
    capture.capture(input_ids=, attention_mask=, loss_mask=)       # .hidden_states [B, L, 3H]
                                                                   # .last_hidden_states [B, L, H]

Every request of one ``capture`` call is a row of ``input_ids``, taken whole (padding
included), so this backend sends one sample per call and never packs. It needs CUDA, SGLang
and SpecForge (the `sglang` extra): it is unit-tested against a stand-in object with the same
interface and has not run here; verify it on a GPU node before a real run. SpecForge's capture
does not import on SGLang 0.5.23 (it needs the 0.5.14 it pins); what 0.5.23 itself computes for
the aux layers is checked against the `hf` files in tests/real_sglang/test_aux_states.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from datagen.extraction.backends.base import set_shape, text_config
from datagen.extraction.backends.hf import DTYPES


class SGLangBackend:
    packs = False

    def __init__(self, capture: Any, config: dict[str, Any], aux_ids: Sequence[int] | None,
                 device: torch.device):
        self.capture = capture
        set_shape(self, config, aux_ids, device)
        capture.set_capture_layers(list(self.aux_layer_ids))

    @torch.no_grad()
    def forward_row(self, id_lists: Sequence[Sequence[int]], out: torch.Tensor) -> None:
        off, split = 0, self.n_aux * self.hidden
        for ids in id_lists:  # one request per call: a request is a whole row of input_ids
            ids_t = torch.tensor([list(ids)], dtype=torch.int64, device=self.device)
            ones = torch.ones_like(ids_t)
            got = self.capture.capture(input_ids=ids_t, attention_mask=ones, loss_mask=ones)
            n = len(ids)
            aux, final = got.hidden_states[0], got.last_hidden_states[0]
            if tuple(aux.shape) != (n, split) or tuple(final.shape) != (n, self.hidden):
                raise RuntimeError(f"sglang capture returned aux {tuple(aux.shape)} and final "
                                   f"{tuple(final.shape)} for {n} tokens; expected "
                                   f"({n}, {split}) and ({n}, {self.hidden})")
            out[off:off + n, :split].copy_(aux)
            out[off:off + n, split:].copy_(final)
            off += n

    def close(self) -> None:
        pass


def create(cfg: Any, device: torch.device) -> SGLangBackend:
    try:
        from specforge.offline_capture import load_offline_capture
    except ImportError as exc:
        raise RuntimeError("extract_backend='sglang' needs SpecForge and SGLang: pip install "
                           "-e '.[sglang]' on a CUDA node") from exc
    # tp_size is not passed: SpecForge reads it from the TP group the replica initialized
    capture = load_offline_capture(cfg.model_path, torch_dtype=DTYPES[cfg.dtype],
                                   trust_remote_code=cfg.trust_remote_code)
    return SGLangBackend(capture, text_config(cfg.model_path), cfg.aux_layer_ids, device)
