"""A tiny random-weight Llama saved as a complete local model folder, for tests and demos.

No download is ever needed: the weights come from ``torch.manual_seed(seed)``, so the same
arguments give the same tensors. torch and transformers are imported inside the function because
CPU-only processes import ``datagen`` without them.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

# Files that make a folder loadable by AutoTokenizer; whichever of them exist are copied.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "generation_config.json",
)


def build_tiny_llama(out_dir: str | Path, vocab_size: int, hidden_size: int = 64,
                     num_layers: int = 6, heads: int = 4, seed: int = 0,
                     tokenizer_dir: str | Path | None = None) -> Path:
    """Write a random LlamaForCausalLM (float32, safetensors) to ``out_dir`` and return it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=heads,
        # half as many kv heads, so grouped-query attention is exercised like in real targets
        num_key_value_heads=max(1, heads // 2), max_position_embeddings=32768,
        tie_word_embeddings=False, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer_dir is not None:
        _copy_tokenizer(Path(tokenizer_dir), out)
    log.info("tiny llama (H=%d, %d layers, vocab %d) written to %s",
             hidden_size, num_layers, vocab_size, out)
    return out


def _copy_tokenizer(src: Path, dst: Path) -> None:
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not copied:
        raise FileNotFoundError(f"no tokenizer files in {src} (looked for {TOKENIZER_FILES})")
    for name in copied:
        shutil.copy2(src / name, dst / name)
