"""A tiny random-weight Llama saved as a complete local model folder, for tests and demos.

No download is ever needed: the weights come from ``torch.manual_seed(seed)``, so the same
arguments give the same tensors. The folder is laid out as a real checkpoint is: weights in
safetensors shards listed by ``model.safetensors.index.json`` (SpecForge's target-head loader
finds ``lm_head.weight`` and the embedding through that index and refuses a folder without
one). torch and transformers are imported inside the functions because CPU-only processes
import ``datagen`` without them.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"

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
    save_sharded(model, out)
    if tokenizer_dir is not None:
        _copy_tokenizer(Path(tokenizer_dir), out)
    log.info("tiny llama (H=%d, %d layers, vocab %d) written to %s",
             hidden_size, num_layers, vocab_size, out)
    return out


def save_sharded(model: object, out: Path, shards: int = 2) -> Path:
    """``save_pretrained`` in about ``shards`` safetensors files plus their index, as hub
    checkpoints are; an index is written for a single file too. Returns the index path."""
    params = list(model.state_dict().values())  # type: ignore[attr-defined]
    total = sum(p.numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    model.save_pretrained(out, max_shard_size=max(largest, total // shards + 1))  # type: ignore[attr-defined]
    index = out / INDEX_NAME
    if not index.is_file():
        write_index(out, ["model.safetensors"])
    return index


def write_index(out: Path, files: list[str]) -> Path:
    """``model.safetensors.index.json`` naming the file of every tensor in ``files``."""
    from safetensors import safe_open

    weight_map: dict[str, str] = {}
    size = 0
    for name in files:
        with safe_open(str(out / name), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 (safe_open has no __iter__)
                weight_map[key] = name
                t = fh.get_slice(key)
                size += _nbytes(t.get_shape(), t.get_dtype())
    body = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    path = out / INDEX_NAME
    path.write_text(json.dumps(body, indent=2) + "\n", encoding="utf-8")
    return path


def _nbytes(shape: list[int], dtype: str) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "BOOL": 1}.get(dtype, 4)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    if not copied:
        raise FileNotFoundError(f"no tokenizer files in {src} (looked for {TOKENIZER_FILES})")
    for name in copied:
        shutil.copy2(src / name, dst / name)
