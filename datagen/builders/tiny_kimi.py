"""A tiny random checkpoint laid out as Kimi-K2.5's: ``KimiK25ForConditionalGeneration``, the
DeepseekV3 text backbone under ``text_config`` (``model_type`` "kimi_k2", as the real one)
and its weights under ``language_model.``, a ``vision_config``, the media token ids.

No vision tower weights: the `vllm` backend asks vLLM for no images or videos
(``--limit-mm-per-prompt`` 0 for each), so vLLM never builds the tower, and extraction is
text only. The text weights are exactly those of ``build_tiny_deepseek_v3(..., for_vllm=True)``
with the same arguments, so a test can hold the two side by side.
"""

from __future__ import annotations

import json
from pathlib import Path

from datagen.builders.tiny_deepseek import build_tiny_deepseek_v3


def build_tiny_kimi_k25(out_dir: str | Path, vocab_size: int, hidden_size: int = 128,
                        num_layers: int = 8, seed: int = 0) -> Path:
    from safetensors.torch import load_file, save_file

    out = Path(out_dir)
    text_dir = build_tiny_deepseek_v3(out / "text-backbone", vocab_size,
                                      hidden_size=hidden_size, num_layers=num_layers,
                                      seed=seed, for_vllm=True)
    text = json.loads((text_dir / "config.json").read_text(encoding="utf-8"))
    text["model_type"] = "kimi_k2"
    state = {}
    for part in sorted(text_dir.glob("*.safetensors")):
        state.update({f"language_model.{k}": v for k, v in load_file(part).items()})
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": text, "vision_config": {"model_type": "kimi_k25_vision"},
              "image_token_id": vocab_size - 2, "video_token_id": vocab_size - 1,
              "tie_word_embeddings": False, "dtype": text.get("dtype", "float32")}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out
