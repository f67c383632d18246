"""What the handoff is checked against: SpecForge's own code and interface at commit a6b6b02
(github.com/sgl-project/SpecForge, Apache-2.0), copied here so the tests need no checkout.

- ``reference_counts`` follows ``specforge/training/vocab_mapping.py``
  ``count_effective_feature_tokens`` (the offline path: sorted feature files, counts of
  ``input_ids[:max_length][loss_mask]``), reading files the way its reader lists them
  (``offline_reader.list_feature_files``: ``.ckpt``/``.ckpt.gz``, absolute paths, sorted);
- ``reference_mappings`` is ``specforge/data/preprocessing.py``
  ``process_token_dict_to_mappings`` with its prints removed;
- ``TRAIN_FLAGS`` are the options of ``specforge train`` (``specforge/cli.py``);
- ``SCHEMA_FIELDS`` are the fields of the run-config sections the handoff writes
  (``specforge/config/schema.py``; every model has ``extra="forbid"``).

``DATAGEN_SPECFORGE_SRC=<a SpecForge checkout>`` makes the handoff test also validate the run
config with that checkout's pydantic schema itself.
"""

from __future__ import annotations

import os
from collections import Counter

import torch

FEATURE_SUFFIXES = (".ckpt", ".ckpt.gz")

TRAIN_FLAGS = {"-c", "--config", "--role", "--node-rank", "--plan"}

SCHEMA_FIELDS = {
    "model": {
        "target_model_path", "draft_model_config", "draft_checkpoint_path",
        "draft_num_hidden_layers", "draft_block_size", "target_backend", "shard_target_output",
        "input_modality", "trust_remote_code", "use_liger_kernel", "embedding_key",
        "lm_head_key", "vocab_mapping_path", "load_target_embedding",
        "aux_hidden_state_layer_ids", "torch_dtype", "cache_dir", "mask_token_id",
        "tokenizer_pad_token_id",
    },
    "data": {
        "train_data_path", "prompts_path", "hidden_states_path", "eval_data_path",
        "eval_hidden_states_path", "max_length", "chat_template", "is_preformatted",
        "train_only_last_turn", "build_dataset_num_proc", "dataloader_num_workers",
        "cache_dir", "cache_key", "max_prompts",
    },
    "training": {"strategy", "num_epochs", "max_steps", "batch_size", "learning_rate",
                 "role", "seed"},
    "": {"model", "data", "training", "tracking", "profiling", "runtime", "deployment",
         "run_id", "output_dir"},
}


def list_feature_files(path: str) -> list[str]:
    files = []
    for root, _dirs, names in os.walk(path):
        for name in names:
            if name.endswith(FEATURE_SUFFIXES):
                files.append(os.path.abspath(os.path.join(root, name)))
    files.sort()
    return files


def reference_counts(hidden_states_path: str, max_length: int | None = None) -> Counter:
    counts: Counter = Counter()
    for path in list_feature_files(hidden_states_path):
        raw = torch.load(path, weights_only=True)
        input_ids = raw["input_ids"].reshape(-1)
        loss_mask = raw["loss_mask"].reshape(-1)
        if max_length is not None:
            input_ids = input_ids[:max_length]
            loss_mask = loss_mask[:max_length]
        selected = input_ids[loss_mask.to(dtype=bool)]
        if selected.numel() == 0:
            continue
        token_ids, frequencies = selected.unique(return_counts=True)
        for token_id, frequency in zip(token_ids.tolist(), frequencies.tolist(), strict=True):
            counts[int(token_id)] += int(frequency)
    return counts


def reference_mappings(token_dict: Counter, draft_vocab_size: int, target_vocab_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    if len(token_dict) < draft_vocab_size:
        existing_tokens = set(token_dict.keys())
        missing_tokens = set(range(draft_vocab_size)) - existing_tokens
        for token in missing_tokens:
            token_dict[token] = 0
            if len(token_dict) >= draft_vocab_size:
                break
    top_N = token_dict.most_common(draft_vocab_size)  # noqa: N806 (SpecForge's name)
    used_tokens = [key for key, freq in top_N]
    used_tokens.sort()
    d2t = [used_tokens[i] - i for i in range(len(used_tokens))]
    t2d = [i in used_tokens for i in range(target_vocab_size)]
    return torch.tensor(d2t), torch.tensor(t2d)
