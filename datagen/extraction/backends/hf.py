"""The target model side of extraction: loading, aux-layer hooks, packed forward.

Only the base model runs (``model.model``): it ends with the final norm, so its
``last_hidden_state`` is exactly what SpecForge stores as ``hidden_state`` and the LM head
(a [L, 128K] matmul and its logits) is never computed. ``output_hidden_states`` is never used
either: it would keep every layer's output alive; forward hooks on the 3 aux layers copy their
outputs straight into the batch's output buffer instead.

Indexing convention, checked by the tests against a plain HF forward: aux layer ``i`` is the
output of decoder layer ``i`` = ``hidden_states[i + 1]`` (``hidden_states[0]`` is the
embedding). HF replaces ``hidden_states[-1]`` by the *post-norm* state, so the output of the last
decoder layer is not available there; an aux id of N-1 here gives the pre-norm output.

Packing: samples of a row are concatenated with ``position_ids`` restarting at 0 for each one
and no attention mask; transformers (5.x, sdpa/eager/flash) derives a block-diagonal causal mask
from the restarts. With flash-attention varlen that is free; with sdpa the mask is dense, so a
packed row of P tokens costs P^2 attention instead of sum(l_i^2): rows are capped at
``pack_tokens`` (4096 by default) where that overhead is at most one 4K sample's worth. Whether
the installed model really isolates packed samples is verified once at load time
(``packing_isolated``); if not, every sample gets its own row.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_model(path: str, dtype: str, device: torch.device, attn_implementation: str,
               trust_remote_code: bool) -> Any:
    from transformers import AutoModelForCausalLM

    kwargs = _load_kwargs(dtype, device, attn_implementation)
    if trust_remote_code:  # never execute a checkpoint's code unless asked
        kwargs["trust_remote_code"] = True
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.to(device).eval()


def _load_kwargs(dtype: str, device: torch.device, attn_implementation: str) -> dict[str, Any]:
    import importlib.util

    import transformers
    from packaging.version import Version

    version = Version(transformers.__version__)
    # "dtype" replaced "torch_dtype" in 4.56; older versions would silently ignore "dtype"
    key = "dtype" if version >= Version("4.56") else "torch_dtype"
    kwargs: dict[str, Any] = {key: DTYPES[dtype], "attn_implementation": attn_implementation}
    # load straight onto the GPU instead of through host memory; 4.x needs accelerate for it
    if device.type == "cuda" and (version.major >= 5 or importlib.util.find_spec("accelerate")):
        kwargs["device_map"] = {"": str(device)}
    return kwargs


def base_model(model: Any) -> Any:
    """The decoder stack ending in the final norm (``model.model`` for Llama-like models)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    return base if base is not None and hasattr(base, "layers") else model


def decoder_layers(base: Any) -> Sequence[torch.nn.Module]:
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TypeError(f"{type(base).__name__} has no .layers: unsupported architecture")
    return layers


class AuxCapture:
    """Forward hooks that copy aux layer outputs into ``target[:, k*H:(k+1)*H]``."""

    def __init__(self, layers: Sequence[torch.nn.Module], aux_ids: Sequence[int], hidden: int):
        self.hidden = hidden
        self.target: torch.Tensor | None = None  # [P, 4H] view, set only around our forward
        slots: dict[int, list[int]] = {}
        for k, layer_id in enumerate(aux_ids):
            slots.setdefault(layer_id, []).append(k)  # one hook even if an id repeats
        self._handles = [layers[i].register_forward_hook(self._hook(ks))
                         for i, ks in slots.items()]

    def _hook(self, slots: list[int]):
        def hook(_module: Any, _args: Any, output: Any) -> None:
            if self.target is None:
                return
            h = output[0] if isinstance(output, tuple) else output  # tuple in transformers 4.x
            for k in slots:
                self.target[:, k * self.hidden:(k + 1) * self.hidden].copy_(h[0])
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class RowRunner:
    """Runs one packed row and fills its [P, 4H] slice: 3 aux states, then the final state."""

    def __init__(self, model: Any, aux_ids: Sequence[int], device: torch.device):
        self.base = base_model(model)
        layers = decoder_layers(self.base)
        n = len(layers)
        if any(not 0 <= i < n for i in aux_ids):
            raise ValueError(f"aux_layer_ids {list(aux_ids)} outside [0, {n}) decoder layers")
        if n - 1 in aux_ids:
            log.warning("aux layer %d is the last decoder layer: stored pre-norm", n - 1)
        self.hidden = int(model.config.hidden_size)
        self.n_aux = len(aux_ids)
        self.width = (self.n_aux + 1) * self.hidden
        self.device = device
        self.capture = AuxCapture(layers, aux_ids, self.hidden)

    @torch.no_grad()
    def forward_row(self, id_lists: Sequence[Sequence[int]], out: torch.Tensor) -> None:
        flat = [t for ids in id_lists for t in ids]
        pos = [p for ids in id_lists for p in range(len(ids))]
        ids_t = torch.tensor([flat], dtype=torch.int64).to(self.device, non_blocking=True)
        pos_t = torch.tensor([pos], dtype=torch.int64).to(self.device, non_blocking=True)
        self.capture.target = out
        try:
            res = self.base(input_ids=ids_t, position_ids=pos_t, use_cache=False)
        finally:
            self.capture.target = None
        out[:, self.n_aux * self.hidden:].copy_(res[0][0])


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).abs().mean() / b.abs().mean().clamp_min(1e-12))


def packing_isolated(runner: RowRunner, vocab_size: int, dtype: torch.dtype) -> bool:
    """True if a packed sample's states do not depend on the sample packed before it.

    Same row shape, same kernels, only the first sample's tokens differ: with isolation the
    second sample's states match to rounding, without it they move visibly."""
    g = torch.Generator().manual_seed(0)
    a1, a2, b = (torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in (7, 7, 9))
    outs = []
    for first in (a1, a2):
        out = torch.empty(16, runner.width, dtype=dtype, device=runner.device)
        runner.forward_row([first, b], out)
        outs.append(out[7:])
    diff = _rel_diff(outs[0], outs[1])
    log.debug("packing isolation check: relative diff %.3g", diff)
    return diff < 1e-3
