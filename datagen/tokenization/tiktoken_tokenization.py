"""A tiktoken-backed `PreTrainedTokenizer`, shaped like Kimi-K2's `TikTokenTokenizer`.

This file is not imported by the package: `datagen.builders.tiktoken_fixture` copies it into a
tokenizer folder as `tokenization_tiny_tiktoken.py`, and `tokenizer_config.json`'s `auto_map`
points `AutoTokenizer` at its class, so transformers loads it as a checkpoint's own code
(only with `trust_remote_code=True`), exactly as it loads Kimi-K2.5's tokenizer.

Like Kimi's, the class reads byte-level BPE ranks from `tiktoken.model` (one
`<base64 token bytes> <rank>` per line), puts the special tokens right after the ranks, and
encodes with a `tiktoken.Encoding`; the HF side sees each token as the GPT-2 byte-to-unicode
spelling of its bytes.

Like Kimi-K2.5's, the class overrides `apply_chat_template`: the tools' keys are sorted at
every depth, and the template gets `tools_ts_str`, the TypeScript-style declaration of
`tool_declaration_ts.py` (copied beside this file), which Kimi-K2.5's template prefers to
its JSON dump of the tools. A server that loads the tokenizer runs this code too.
"""

from __future__ import annotations

import base64
import os
from shutil import copyfile
from typing import Any

import tiktoken
from transformers import PreTrainedTokenizer

from .tool_declaration_ts import encode_tools_to_typescript_style

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}
# GPT-2's pre-split: contractions, letters, digits, other symbols, whitespace runs.
PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Kimi's tool-call markers come last: the ids of the tokens before them stay what they were.
SPECIAL_TOKENS = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>",
                  "<|im_system|>", "<|im_middle|>", "<think>", "</think>", "[PAD]", "[UNK]",
                  "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                  "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")


def read_ranks(path: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as fh:
        for line in fh:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def byte_to_unicode() -> dict[int, str]:
    # GPT-2's table: printable bytes stand for themselves, the others move above 255.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def deep_sort(value: Any) -> Any:
    """Every mapping's keys in sorted order, at every depth; lists keep their order."""
    if isinstance(value, dict):
        return {key: deep_sort(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [deep_sort(item) for item in value]
    return value


class TinyTikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, bos_token: str = "[BOS]", eos_token: str = "<|im_end|>",
                 pad_token: str = "[PAD]", unk_token: str = "[UNK]", **kwargs: Any) -> None:
        self.vocab_file = vocab_file
        ranks = read_ranks(vocab_file)
        self.special_tokens = {tok: len(ranks) + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self.model = tiktoken.Encoding(name=os.path.basename(vocab_file), pat_str=PAT_STR,
                                       mergeable_ranks=ranks, special_tokens=self.special_tokens)
        spell = byte_to_unicode()
        self.byte_decoder = {ch: b for b, ch in spell.items()}
        self.decoder = {rank: "".join(spell[b] for b in token) for token, rank in ranks.items()}
        self.decoder.update({i: tok for tok, i in self.special_tokens.items()})
        self.encoder = {tok: i for i, tok in self.decoder.items()}
        kwargs.pop("additional_special_tokens", None)
        super().__init__(bos_token=bos_token, eos_token=eos_token, pad_token=pad_token,
                         unk_token=unk_token,
                         additional_special_tokens=[t for t in SPECIAL_TOKENS
                                                    if t not in (bos_token, eos_token, pad_token,
                                                                 unk_token)],
                         **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        # Special tokens were split off by the base class; what is left is plain text.
        return [self.decoder[i] for i in self.model.encode(text, disallowed_special=())]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.special_tokens["[UNK]"])

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out = bytearray()
        for token in tokens:
            if token in self.special_tokens:
                out += token.encode("utf-8")
            else:
                out += bytes(self.byte_decoder[ch] for ch in token)
        return out.decode("utf-8", "replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None
                        ) -> tuple[str]:
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        target = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(target):
            copyfile(self.vocab_file, target)
        return (target,)

    def apply_chat_template(self, conversation: Any, tools: list[dict] | None = None,
                            **kwargs: Any) -> Any:
        tools = deep_sort(tools)
        declared = encode_tools_to_typescript_style(tools) if tools else ""
        if declared:
            kwargs["tools_ts_str"] = declared
        return super().apply_chat_template(conversation, tools=tools, **kwargs)
