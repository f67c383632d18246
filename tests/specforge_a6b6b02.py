"""What the handoff is checked against: SpecForge's behaviour and interface at commit a6b6b02
(github.com/sgl-project/SpecForge), written down here in this project's own code so the tests
need no checkout.

- ``reference_counts``: what ``specforge/training/vocab_mapping.py``
  ``count_effective_feature_tokens`` counts on the offline path (loss-masked ids of the first
  ``max_length`` positions of every ``.ckpt``/``.ckpt.gz`` file, files in sorted order);
- ``reference_mappings``: the rule of ``specforge/data/preprocessing.py``
  ``process_token_dict_to_mappings``, computed another way than
  ``datagen/training/vocab_mapping.py``;
- ``TRAIN_FLAGS`` are the options of ``specforge train`` (``specforge/cli.py``);
- ``SCHEMA_FIELDS`` are the fields of the run-config sections the handoff writes
  (``specforge/config/schema.py``; every model has ``extra="forbid"``).

``tests/workers/test_handoff_files.py`` also runs SpecForge's own code (PyPI ``specforge``
0.2.0, installed by ``make install`` without its dependencies) on the handoff.
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
    """The files SpecForge's offline reader trains on: every ``.ckpt``/``.ckpt.gz`` below
    ``path``, as absolute paths in sorted order."""
    found = (os.path.abspath(os.path.join(root, name))
             for root, _dirs, names in os.walk(path) for name in names
             if name.endswith(FEATURE_SUFFIXES))
    return sorted(found)


def reference_counts(hidden_states_path: str, max_length: int | None = None) -> Counter:
    """Loss-masked token counts over the files, the first ``max_length`` positions of each,
    walked in SpecForge's order; within a file ids are added ascending (as ``unique`` gives
    them), which fixes the order ties are broken in."""
    counts: Counter = Counter()
    for path in list_feature_files(hidden_states_path):
        tensors = torch.load(path, weights_only=True)
        ids = tensors["input_ids"].reshape(-1).tolist()[:max_length]
        mask = tensors["loss_mask"].reshape(-1).tolist()[:max_length]
        in_file = Counter(token for token, keep in zip(ids, mask, strict=True) if keep)
        for token in sorted(in_file):
            counts[token] += in_file[token]
    return counts


def reference_mappings(token_dict: Counter, draft_vocab_size: int, target_vocab_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule spelled out another way: rank by (count, first seen), top up a short list with
    unseen ids at count 0 in the iteration order of the set SpecForge builds, keep the top
    ``draft_vocab_size``, sort ascending."""
    first_seen = {token: n for n, token in enumerate(token_dict)}
    table = [(-count, first_seen[token], token) for token, count in token_dict.items()]
    if len(table) < draft_vocab_size:
        fill = set(range(draft_vocab_size)).difference(token_dict)
        table += [(0, len(first_seen) + n, token) for n, token in enumerate(fill)]
    kept = sorted(token for _, _, token in sorted(table)[:draft_vocab_size])
    d2t = torch.tensor([token - n for n, token in enumerate(kept)])
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d
