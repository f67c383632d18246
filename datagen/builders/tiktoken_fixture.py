"""A tokenizer folder shaped like Kimi-K2.5's: custom tiktoken code behind `auto_map`.

Kimi-K2.x ships its tokenizer as code: `tokenizer_config.json` maps `AutoTokenizer` to
`tokenization_kimi.TikTokenTokenizer`, a `PreTrainedTokenizer` that wraps a `tiktoken.Encoding`
built from the `tiktoken.model` ranks, and transformers loads it only with
`trust_remote_code=True`. `build_tiktoken_tokenizer` writes a small folder of the same
structure, fully offline: ranks from the tiny tokenizer's BPE merges (trained in code), the
class of `datagen/tokenization/tiktoken_tokenization.py`, and a chat template that renders what
Kimi-K2.5's does (its role markers, tools, calls, results and thinking; a thinking switch read
from the template kwargs, `thinking`, true by default):

    <|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace ...<|im_end|>
                               (with tools: the tokenizer's TypeScript declaration of them)
    <|im_system|>system<|im_middle|>...<|im_end|><|im_user|>user<|im_middle|>...<|im_end|>
    <|im_assistant|>assistant<|im_middle|><think></think>text<|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{"a":1}<|tool_call_end|>
      <|tool_calls_section_end|><|im_end|>        (a turn before the last user turn: no reasoning)
    <|im_system|>NAME<|im_middle|>## Return of ID\nresult<|im_end|>             (a tool result)
    <|im_assistant|>assistant<|im_middle|><think>reasoning</think>...  (after the last user turn)
    <|im_assistant|>assistant<|im_middle|><think>            (generation prompt, thinking on)
    <|im_assistant|>assistant<|im_middle|><think></think>    (thinking = false)

A turn's `name` stands for its role, as in Kimi's template; content may be a list of text parts.
"""

from __future__ import annotations

import base64
import json
import logging
import shutil
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

MODULE_NAME = "tokenization_tiny_tiktoken"
CLASS_NAME = "TinyTikTokenTokenizer"
EOS_TOKEN = "<|im_end|>"

CHAT_TEMPLATE = r"""{%- macro render_content(message) -%}
{%- if message['content'] is string -%}{{- message['content'] -}}
{%- elif message['content'] is not none -%}
{%- for part in message['content'] -%}
{%- if part['type'] == 'text' -%}{{- part['text'] -}}
{%- else -%}{{- raise_exception("message part of type '" ~ part['type'] ~ "'") -}}{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
{{- '<|im_system|>tool_declare<|im_middle|>' -}}
{%- if tools_ts_str -%}{{- tools_ts_str -}}
{%- else -%}{{- tools | tojson(separators=(',', ':')) -}}{%- endif -%}
{{- '<|im_end|>' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
{%- set role_name = message.get('name') or message['role'] -%}
{%- if message['role'] == 'user' -%}{{- '<|im_user|>' -}}
{%- elif message['role'] == 'assistant' -%}{{- '<|im_assistant|>' -}}
{%- elif message['role'] in ['system', 'tool'] -%}{{- '<|im_system|>' -}}
{%- else -%}{{- raise_exception("unknown role '" ~ message['role'] ~ "'") -}}
{%- endif -%}
{{- role_name ~ '<|im_middle|>' -}}
{%- if message['role'] == 'assistant' -%}
{%- if loop.index0 > ns.last_user -%}
{{- '<think>' ~ (message.get('reasoning_content') or '') ~ '</think>' -}}
{%- else -%}{{- '<think></think>' -}}{%- endif -%}
{{- render_content(message) -}}
{%- if message.get('tool_calls') -%}
{{- '<|tool_calls_section_begin|>' -}}
{%- for call in message['tool_calls'] -%}
{%- set arguments = call['function']['arguments'] -%}
{%- set call_id = call.get('id') or 'functions.' ~ call['function']['name'] ~ ':' ~ loop.index0 -%}
{{- '<|tool_call_begin|>' ~ call_id ~ '<|tool_call_argument_begin|>' -}}
{{- arguments if arguments is string else arguments | tojson -}}
{{- '<|tool_call_end|>' -}}
{%- endfor -%}
{{- '<|tool_calls_section_end|>' -}}
{%- endif -%}
{%- elif message['role'] == 'tool' -%}
{{- '## Return of ' ~ (message.get('tool_call_id') or '') ~ '\n' ~ render_content(message) -}}
{%- else -%}{{- render_content(message) -}}
{%- endif -%}
{{- '<|im_end|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_assistant|>assistant<|im_middle|>' -}}
{%- if thinking is defined and thinking is false -%}{{- '<think></think>' -}}
{%- else -%}{{- '<think>' -}}{%- endif -%}
{%- endif -%}"""


def _ranks(vocab_size: int) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then the tiny tokenizer's merges in their order."""
    from datagen.tokenization.tiktoken_tokenization import byte_to_unicode
    from datagen.tokenization.tokenizer import _train_bpe

    spelled = {ch: b for b, ch in byte_to_unicode().items()}
    vocab = _train_bpe(vocab_size).get_vocab(with_added_tokens=False)
    ranks = {bytes([b]): b for b in range(256)}
    for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        if all(ch in spelled for ch in token):
            raw = bytes(spelled[ch] for ch in token)
            ranks.setdefault(raw, len(ranks))
    return ranks


def build_tiktoken_tokenizer(out_dir: Path, vocab_size: int = 2048,
                             chat_template: str = CHAT_TEMPLATE) -> Path:
    """Write a Kimi-style custom-code tokenizer folder into out_dir; loads only with
    `AutoTokenizer.from_pretrained(out_dir, trust_remote_code=True)`. ``chat_template``:
    another template than the demo's (a test passes Kimi-K2.5's published one)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ranks = _ranks(vocab_size)
    with open(out_dir / "tiktoken.model", "w", encoding="ascii") as fh:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            fh.write(f"{base64.b64encode(token).decode()} {rank}\n")
    for name, target in (("tiktoken_tokenization.py", f"{MODULE_NAME}.py"),
                         ("tool_declaration_ts.py", "tool_declaration_ts.py")):
        source = resources.files("datagen.tokenization").joinpath(name)
        with resources.as_file(source) as path:
            shutil.copyfile(path, out_dir / target)
    config = {
        "tokenizer_class": CLASS_NAME,
        "auto_map": {"AutoTokenizer": [f"{MODULE_NAME}.{CLASS_NAME}", None]},
        "bos_token": "[BOS]", "eos_token": EOS_TOKEN, "pad_token": "[PAD]",
        "unk_token": "[UNK]", "model_max_length": 32_768,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                                   encoding="utf-8")
    with open(out_dir / "chat_template.jinja", "w", encoding="utf-8", newline="") as fh:
        fh.write(chat_template)
    logger.info("built tiktoken tokenizer in %s (%d ranks)", out_dir, len(ranks))
    return out_dir
