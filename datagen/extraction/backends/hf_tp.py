"""The `hf-tp` backend: transformers tensor parallelism over the replica's ranks.

``from_pretrained(..., tp_plan="auto")`` splits each layer by the model's own plan (attention
heads and MLP columns/rows, experts for MoE models such as DeepSeek-V3) across the ranks of the
default process group, which the replica has initialized before (gloo on CPU, nccl on CUDA).
Every rank runs every row with the same ids; the layer outputs, the aux states the hooks copy
and the final norm's output are whole on every rank (the row-parallel projections all-reduce),
so rank 0 alone writes them. Needs ``accelerate`` (the `gpu` extra).
"""

from __future__ import annotations

from typing import Any

import torch

from datagen.extraction.backends.hf import HFBackend, _load_kwargs, aux_ids_for


def create(cfg: Any, device: torch.device) -> HFBackend:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    if not dist.is_initialized():
        raise RuntimeError("hf-tp needs the replica's process group (datagen worker gpu "
                           "--gpus/--ranks starts it)")
    kwargs = _load_kwargs(cfg.dtype, device, cfg.attn_implementation)
    kwargs.pop("device_map", None)  # the tp plan places each rank's part itself
    if cfg.trust_remote_code:
        kwargs["trust_remote_code"] = True
    model = AutoModelForCausalLM.from_pretrained(cfg.model_path, tp_plan="auto", **kwargs)
    return HFBackend(model.eval(), aux_ids_for(model, cfg.aux_layer_ids), device)
