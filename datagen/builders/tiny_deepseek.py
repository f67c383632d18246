"""A tiny random-weight DeepseekV3 (MLA attention + mixture of experts) as a local model folder.

The shape of Kimi-K2's text backbone, shrunk: low-rank q/kv projections (``q_lora_rank``,
``kv_lora_rank``), 8 routed experts of which 2 per token, one shared expert, the first layer
dense (``first_k_dense_replace=1``). For tests of the tensor-parallel and vllm backends;
nothing is downloaded, the weights come from ``torch.manual_seed(seed)``.

vLLM's CPU MLA kernel takes only DeepSeek's own latent width, ``kv_lora_rank`` 512 +
``qk_rope_head_dim`` 64 ("Head dimension 24 is not supported by MLA" otherwise), and vLLM's
DeepseekV3 loads the router's ``e_score_correction_bias`` only with ``topk_method: noaux_tc``
in config.json (transformers' DeepseekV3 always has it): ``for_vllm=True`` builds that shape.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def build_tiny_deepseek_v3(out_dir: str | Path, vocab_size: int, hidden_size: int = 64,
                           num_layers: int = 6, heads: int = 4, seed: int = 0,
                           for_vllm: bool = False) -> Path:
    """Write a random DeepseekV3ForCausalLM (float32, safetensors) to ``out_dir``."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    latent = ({"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64,
               "v_head_dim": 64} if for_vllm else
              {"kv_lora_rank": hidden_size // 4, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
               "v_head_dim": 16})
    config = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=heads,
        q_lora_rank=hidden_size // 2, **latent,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
        topk_group=1, first_k_dense_replace=1, max_position_embeddings=32768,
        rope_scaling=None, tie_word_embeddings=False, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    if for_vllm:
        path = out / "config.json"
        saved = json.loads(path.read_text(encoding="utf-8"))
        saved["topk_method"] = "noaux_tc"
        path.write_text(json.dumps(saved, indent=2) + "\n", encoding="utf-8")
    log.info("tiny deepseek-v3 (H=%d, %d layers, 8 experts, vocab %d) written to %s",
             hidden_size, num_layers, vocab_size, out)
    return out
