"""What capture does to the KV cache of one 8 x H200 node serving INT4 Kimi-K2.5: arithmetic
from the model's shape, not a measurement (bench/bench_capture.py measures the same ratio on a
tiny model and checks it against the same formula).

Per token, on every GPU of a tensor-parallel-8 replica (vLLM keeps the MLA latent whole on each
rank, and its hidden-state cache layer is not divided by TP either):

    MLA cache     61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 B (bf16)
    states        4 captured ids (vLLM ids of aux layers [1, 29, 57] + 1, and 61) x 7168 x 2 B
                  (bf16; vLLM keeps them unquantized even with an fp8 KV cache)
"""

from __future__ import annotations

from typing import Any

from datagen.extraction.estimate import default_aux_layer_ids
from datagen.servers.capture import vllm_capture

LAYERS, HIDDEN, KV_LORA_RANK, ROPE_DIM = 61, 7168, 512, 64  # DeepSeek-V3 backbone
BF16, FP8 = 2, 1
H200_GB = 141.0
GPU_MEMORY_UTILIZATION = 0.90  # vLLM's default share of the GPU
WEIGHTS_GB = 595.0  # assumed: the INT4 checkpoint's size (~594 GB for Kimi-K2 INT4), not read
OVERHEAD_GB = 8.0   # assumed: activations, CUDA graphs, NCCL buffers per GPU
TOKENS_PER_REQUEST = 4096  # assumed: a request at its full length, ~300 prompt + ~3.7K output


def kimi_node(gpus: int = 8) -> dict[str, Any]:
    ids, _ = vllm_capture(default_aux_layer_ids(LAYERS), LAYERS)
    mla = LAYERS * (KV_LORA_RANK + ROPE_DIM) * BF16
    mla_fp8 = LAYERS * (KV_LORA_RANK + ROPE_DIM) * FP8
    states = len(ids) * HIDDEN * BF16
    kv_gb = H200_GB * GPU_MEMORY_UTILIZATION - WEIGHTS_GB / gpus - OVERHEAD_GB
    off, on = kv_gb * 1e9 / mla, kv_gb * 1e9 / (mla + states)
    return {
        "captured_vllm_ids": ids, "mla_bytes_per_token": mla, "states_bytes_per_token": states,
        "mla_fp8_bytes_per_token": mla_fp8,
        "kv_gb_per_gpu": round(kv_gb, 1),
        "kv_gb_per_gpu_arithmetic": f"{H200_GB} x {GPU_MEMORY_UTILIZATION} - {WEIGHTS_GB} / "
                                    f"{gpus} - {OVERHEAD_GB} (weights and overhead assumed)",
        "tokens_off": round(off), "tokens_on": round(on),
        "on_over_off": round(mla / (mla + states), 3),
        "on_over_off_fp8_kv": round(mla_fp8 / (mla_fp8 + states), 3),
        "tokens_per_request": TOKENS_PER_REQUEST,
        "requests_off": int(off // TOKENS_PER_REQUEST),
        "requests_on": int(on // TOKENS_PER_REQUEST),
    }
