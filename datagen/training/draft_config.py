"""The EAGLE-3 draft config (JSON) that SpecForge trains and SGLang serves, from the target's.

Built the way SpecForge derives one when ``model.draft_model_config`` is omitted
(``specforge/training/model_loading.py`` ``_generate_draft_config``, checked at a6b6b02): the
target's architecture fields are copied, then one ``LlamaForCausalLMEagle3`` layer, untied
embeddings and the draft vocabulary are set. What SpecForge's generator leaves to its defaults
and this file states: ``eagle_config.eagle_aux_hidden_state_layer_ids``, the aux layers the
files were actually extracted from. SpecForge (aux-layer override) and SGLang
(``--speculative-algorithm EAGLE3``) both read them there, so a non-default choice cannot
silently train or serve on other layers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ARCHITECTURE = "LlamaForCausalLMEagle3"

# SpecForge's _TARGET_ARCHITECTURE_FIELDS: copied from the target when present.
TARGET_FIELDS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "max_position_embeddings", "rms_norm_eps", "hidden_act",
    "initializer_range", "attention_bias", "attention_dropout", "head_dim", "rope_theta",
    "rope_scaling", "bos_token_id", "eos_token_id", "pad_token_id", "sliding_window",
    "use_sliding_window", "max_window_layers",
)


def read_target_config(model_path: str | Path) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ValueError(f"model_path: no config.json in {model_path}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return config


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part (multimodal checkpoints such as Kimi-K2.5 nest it)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def target_vocab_size(config: dict[str, Any]) -> int:
    """As SpecForge reads it: ``padded_vocab_size`` when the config has one."""
    text = text_config(config)
    size = text.get("padded_vocab_size") or text.get("vocab_size")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"target config: no usable vocab_size ({size!r})")
    return size


def draft_config(target: dict[str, Any], aux_layer_ids: Sequence[int], draft_vocab_size: int,
                 torch_dtype: str) -> dict[str, Any]:
    """The draft config for a target config.json dict and the aux ids actually extracted."""
    text = text_config(target)
    if "hidden_size" not in text:
        raise ValueError("target config: no hidden_size, cannot size a draft model")
    out: dict[str, Any] = {"architectures": [ARCHITECTURE]}
    for name in TARGET_FIELDS:
        if text.get(name) is not None:
            out[name] = text[name]
    rope = text.get("rope_parameters")  # transformers 5 writes rope_theta inside this
    if "rope_theta" not in out and isinstance(rope, dict) and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    out["vocab_size"] = target_vocab_size(target)
    out.update({
        "model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False,
        "use_cache": True, "torch_dtype": torch_dtype,
        "draft_vocab_size": draft_vocab_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layer_ids],
                         "use_aux_hidden_state": True},
    })
    if out.get("pad_token_id") is None:
        out["pad_token_id"] = 0
    return out
