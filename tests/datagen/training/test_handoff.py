"""The SpecForge handoff's pure parts: the vocab mapping's rules, the merge of per-shard counts,
the draft config from a target's config.json, the length rule and the settings behind them."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from specforge_a6b6b02 import reference_mappings

from config.settings import SettingsError, load_settings
from datagen.training import draft_config as dc
from datagen.training import vocab_mapping as vm
from datagen.training.handoff import LengthCount, kept_length, loss_mask, online_row


def tied_counter(rng: random.Random, n_tokens: int, vocab: int) -> Counter:
    """Counts with many ties, inserted in a random order (ties go to the first inserted)."""
    ids = rng.sample(range(vocab), n_tokens)
    return Counter({t: rng.choice((0, 1, 2, 2, 3, 5)) for t in ids})


@pytest.mark.parametrize(("n_tokens", "draft", "target"), [
    (200, 64, 300),    # more distinct ids than the draft vocabulary: ties decide the cut
    (20, 64, 300),     # fewer: ids of range(64) are added at count 0
    (300, 300, 300),   # draft = target: every id
    (5, 10, 10),
])
def test_mapping_equals_specforge_with_its_tie_and_fill_rules(n_tokens, draft, target):
    rng = random.Random(n_tokens * 7 + draft)
    for _ in range(20):
        counts = tied_counter(rng, n_tokens, target)
        d2t, t2d = vm.mappings(counts, draft, target)
        ref_d2t, ref_t2d = reference_mappings(Counter(counts), draft, target)
        assert d2t == ref_d2t.tolist() and t2d == ref_t2d.tolist()
        assert len(d2t) == draft and sum(t2d) == draft
        used = [d + i for i, d in enumerate(d2t)]
        assert used == sorted(used) and all(t2d[u] for u in used)


def test_ties_follow_the_order_specforge_counts_in():
    # ids 7 and 3 both counted twice: the one whose first file sorts first wins the last slot
    first = vm.count_samples([("rows_0-2000/data_10.ckpt", [5, 7, 7], [0, 1, 1])])
    second = vm.count_samples([("rows_0-2000/data_2.ckpt", [3, 3, 9, 9, 9], [1, 1, 1, 1, 1])])
    merged = vm.merge_counts([second, first])  # shard order does not matter
    # "data_10" < "data_2" as strings: SpecForge sorts paths, so 7 is counted before 3 and 9
    assert list(merged.items()) == [(7, 2), (3, 2), (9, 3)]
    d2t, _ = vm.mappings(merged, 2, 12)
    assert [d + i for i, d in enumerate(d2t)] == [7, 9]


def test_merged_shard_counts_rebuild_one_sequential_count():
    rng = random.Random(1)
    files = []
    for idx in rng.sample(range(5000), 60):
        n = rng.randint(2, 30)
        ids = [rng.randrange(50) for _ in range(n)]
        mask = [0] * rng.randint(0, n - 1) + [1] * n
        files.append((f"rows_{idx // 2000 * 2000}-{idx // 2000 * 2000 + 2000}/data_{idx}.ckpt",
                      ids, mask[:n]))
    # SpecForge: files in sorted order, each file's ids ascending
    sequential: Counter = Counter()
    for _, ids, mask in sorted(files):
        for t in sorted({t for t, m in zip(ids, mask, strict=True) if m}):
            sequential[t] += sum(1 for u, m in zip(ids, mask, strict=True) if m and u == t)
    rng.shuffle(files)
    shards = [vm.count_samples(files[i::3]) for i in range(3)]
    assert list(vm.merge_counts(shards).items()) == list(sequential.items())


def test_shard_counts_round_trip_through_their_file(tmp_path):
    counts = vm.count_samples([("a/data_1.ckpt", [4, 4, 2], [0, 1, 1]),
                               ("a/data_0.ckpt", [4, 8], [1, 1])])
    path = vm.write_shard_counts(tmp_path, "shards__shard_00000", counts, {"max_length": 9})
    back, meta = vm.read_shard_counts(path)
    assert back == counts == {4: (2, "a/data_0.ckpt"), 2: (1, "a/data_1.ckpt"),
                              8: (1, "a/data_0.ckpt")}
    assert meta["max_length"] == 9
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a vocab counts file"):
        vm.read_shard_counts(path)


def test_draft_vocab_is_capped_at_a_smaller_target_vocab():
    assert vm.effective_draft_vocab(32000, 4096) == 4096
    assert vm.effective_draft_vocab(32000, 163840) == 32000


# datagen/builders/tiny_model.py's config.json (transformers 5 writes rope_parameters)
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 1, "eos_token_id": 2, "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
    "max_position_embeddings": 32768, "model_type": "llama", "num_attention_heads": 4,
    "num_hidden_layers": 6, "num_key_value_heads": 2, "pad_token_id": None,
    "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False, "vocab_size": 4096,
}

DEEPSEEK_V3 = {  # the fields of deepseek-ai/DeepSeek-V3's config.json that size a draft
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 256, "vocab_size": 129280,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "bos_token_id": 0, "eos_token_id": 1, "hidden_act": "silu", "attention_bias": False,
    "attention_dropout": 0.0, "initializer_range": 0.02, "tie_word_embeddings": False,
}


def check_common(cfg: dict, target: dict, aux: list[int], draft_vocab: int) -> None:
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["model_type"] == "llama" and cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is False and cfg["draft_vocab_size"] == draft_vocab
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": aux,
                                   "use_aux_hidden_state": True}
    for name in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "max_position_embeddings", "rms_norm_eps", "hidden_act",
                 "bos_token_id", "eos_token_id"):
        assert cfg[name] == target[name], name


def test_draft_config_from_a_tiny_llama_config():
    cfg = dc.draft_config(TINY_LLAMA, [1, 2, 2], 4096, "bfloat16")
    check_common(cfg, TINY_LLAMA, [1, 2, 2], 4096)
    assert cfg["head_dim"] == 16 and cfg["rope_theta"] == 10000.0
    assert cfg["pad_token_id"] == 0 and cfg["torch_dtype"] == "bfloat16"


def test_draft_config_from_a_deepseek_v3_config_and_a_nested_one():
    cfg = dc.draft_config(DEEPSEEK_V3, [1, 29, 57], 32000, "bfloat16")
    check_common(cfg, DEEPSEEK_V3, [1, 29, 57], 32000)
    assert cfg["rope_scaling"] == DEEPSEEK_V3["rope_scaling"]
    assert "q_lora_rank" not in cfg and "n_routed_experts" not in cfg  # MLA/MoE stay in the target
    # Kimi-K2.5 nests its DeepSeek-V3 text model under text_config
    kimi = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "text_config": {**DEEPSEEK_V3, "vocab_size": 163840}}
    nested = dc.draft_config(kimi, [2, 30, 58], 32000, "bfloat16")
    assert nested["vocab_size"] == 163840 and nested["hidden_size"] == 7168
    assert dc.target_vocab_size(kimi) == 163840
    with pytest.raises(ValueError, match="hidden_size"):
        dc.draft_config({"vocab_size": 10}, [1, 2, 3], 10, "bfloat16")


@pytest.mark.parametrize(("n_prompt", "n_total", "overlong", "kept"), [
    (10, 30, "truncate", 25),   # cut at the limit
    (10, 20, "truncate", 20),   # fits
    (10, 30, "skip", 0),        # too long, dropped
    (24, 30, "truncate", 0),    # one response token left: SpecForge zeroes the last position
    (23, 30, "truncate", 25),   # two left: one trained on
    (30, 40, "truncate", 0),    # the prompt alone fills the limit
    (5, 6, "truncate", 0),      # a one-token response trains nothing
])
def test_length_rule(n_prompt, n_total, overlong, kept):
    assert kept_length(n_prompt, n_total, 25, overlong)[0] == kept


def test_length_count_and_the_online_row_agree_with_the_rule():
    c = LengthCount()
    for n_prompt, n_total in ((10, 30), (24, 30), (3, 8)):
        c.add(n_prompt, n_total, 25, "truncate")
    assert (c.dropped, c.dropped_tokens, c.cut, c.cut_tokens) == (1, 30, 1, 5)
    rec = {"id": "x", "dataset": "B1", "prompt_ids": [1] * 10, "output_ids": list(range(20))}
    row = online_row(rec, 25, "truncate")
    assert row is not None and '"loss_mask":[0,0,0,0,0,0,0,0,0,0,1,' in row
    assert online_row({**rec, "prompt_ids": [1] * 24}, 25, "truncate") is None


def test_renamed_and_removed_settings_fail_with_their_new_name(tmp_path):
    old = tmp_path / "old.toml"
    old.write_text("extract_max_length_tokens = 4096\n")
    with pytest.raises(SettingsError, match="extract_max_length_tokens is now train_max_length"):
        load_settings(old, env={})
    gone = tmp_path / "gone.toml"
    gone.write_text('extract_file_format = "safetensors"\n')
    with pytest.raises(SettingsError, match="extract_file_format was removed"):
        load_settings(gone, env={})
    with pytest.raises(SettingsError, match="DATAGEN_TRAIN_MAX_LENGTH"):
        load_settings(env={"DATAGEN_EXTRACT_MAX_LENGTH_TOKENS": "4096"})
    assert load_settings(env={}).train_max_length == 2048
    assert load_settings(env={}).draft_vocab_size == 32000


def test_length_rule_and_mask_with_several_generated_turns():
    # prompt 0-5, turn 1 at [5, 8), the template between turns [8, 12), turn 2 at [12, 20)
    spans = [(5, 8), (12, 20)]
    assert kept_length(5, 20, 10, "truncate", spans) == (10, "")
    assert kept_length(5, 20, 6, "truncate", spans)[0] == 0  # position 5 is the last kept
    assert loss_mask(5, 10, spans) == [0] * 5 + [1] * 3 + [0] * 2
    assert loss_mask(5, 20) == [0] * 5 + [1] * 15
