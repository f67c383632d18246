"""How to ask SGLang 0.5.23's own ``sglang.Engine`` for the aux layer states the `sglang`
backend stores: the settings and the layer-id rule that tests/real_sglang/ checks against the
`hf` backend's files. SpecForge's capture (backends/sglang.py) cannot run on SGLang 0.5.23
(docs/DESIGN.md, "Backends"); this is SGLang's public path to the same states.

SGLang 0.5.23 returns hidden states from its public API in two ways, never both from one
engine:

- with ``enable_return_aux_hidden_states`` (+ ``speculative_algorithm="EAGLE3"``, which then
  only names the capture convention, and ``return_aux_hidden_state_layer_ids``), a request
  with ``return_hidden_states=True`` gets the captured layer outputs, concatenated
  [L, n*H], *in place of* the final state (the model's ``set_eagle3_layers_to_capture``;
  the last decoder layer cannot be captured: a layer's output is captured as the next
  layer's input);
- with ``enable_return_hidden_states`` alone it gets the final post-norm state [L, H].

A backend over the public API would need two engines over the same checkpoint (twice the
weights, twice the forwards); SpecForge's capture gets both from one extend forward of one
ModelRunner. No such backend is built yet.

The captured layers come back in layer order, whatever order they were asked in, and a layer
id may not repeat: ask for the sorted distinct ids (``aux_request_ids``) and put the columns
back in the order, repeats included, the backend stores them. Radix (prefix) caching is off,
else a row sharing a prefix with an earlier one would be only partly computed and returned;
chunked prefill is off, so a row is one extend forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The KV pool each engine reserves: a row is computed once and freed, so the pool needs to
# hold only the longest row (SGLang otherwise sizes it from free memory).
DEFAULT_MAX_TOTAL_TOKENS = 32768
# The share of free memory SGLang may hold for weights and pools; its own default is computed
# from the device's memory and comes out negative on a busy CPU host ("Loaded weights leave
# no GPU memory for the KV cache under --mem-fraction-static=-0.049").
DEFAULT_MEM_FRACTION = 0.3


def engine_kwargs(model_path: str, dtype: str, trust_remote_code: bool, device: str,
                  max_total_tokens: int, mem_fraction: float) -> dict[str, Any]:
    """Settings for an engine whose returned states cover every token of every row: no prefix
    cache, one forward per row, token ids in and out."""
    return {"model_path": model_path, "dtype": dtype, "trust_remote_code": trust_remote_code,
            "device": device, "disable_radix_cache": True, "chunked_prefill_size": -1,
            "max_total_tokens": max_total_tokens, "mem_fraction_static": mem_fraction,
            "skip_tokenizer_init": True,
            "log_level": "warning"}


def aux_capture_kwargs(layer_ids: Sequence[int]) -> dict[str, Any]:
    """The engine settings that make ``return_hidden_states`` answer the outputs of the
    decoder layers ``aux_request_ids(layer_ids)[0]``, concatenated, instead of the final
    state (EAGLE3 names the capture convention only: no draft is loaded)."""
    return {"enable_return_aux_hidden_states": True, "speculative_algorithm": "EAGLE3",
            "return_aux_hidden_state_layer_ids": aux_request_ids(layer_ids)[0]}


def aux_request_ids(layer_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """(distinct ids in layer order, for SGLang; for each asked id, its column there)."""
    distinct = sorted(set(layer_ids))
    return distinct, [distinct.index(i) for i in layer_ids]
