"""Chat-template tokenization, and a tiny offline tokenizer for tests and the demo.

`ChatEncoder` wraps any Hugging Face tokenizer folder (the target model's, or the tiny one) and
turns normalised conversations (``datagen.conversation``) into prompt token ids the way SGLang's
`/generate` wants them: ``apply_chat_template(messages, tools=tools, add_generation_prompt=True,
**chat_template_kwargs)``, then tokenized without adding special tokens. Multi-part content
reaches a template that loops over parts as parts, and any other template as its text parts
joined by a space, as SGLang 0.5.23 decides (``detect_jinja_template_content_format``).

`build_tiny_tokenizer` writes a small byte-level BPE tokenizer with a Llama-3/Qwen-style chat
template (a plain one: string content only; tools declared in a first system turn, calls as
Qwen's `<tool_call>` JSON, results as `tool` turns, the reasoning of the turns after the last
user turn in `<think>`), trained on text generated in code, so tests and `make demo` never
touch the network.
`read_tokenizer_info` reads its (or any saved tokenizer's) eos id and vocabulary size from the JSON
files alone where there are any (no transformers import), else loads the folder as the producer
does (a custom-code tokenizer such as Kimi's, with trust_remote_code).

transformers is imported lazily: it costs about a second and a few hundred MB, and the producer
only needs it once it really tokenizes.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|begin|>"
EOS_TOKEN = "<|eot|>"
HEADER_START = "<|header_start|>"
HEADER_END = "<|header_end|>"
# Qwen3 keeps its think tags as ordinary added tokens (not special), so decoding with
# skip_special_tokens keeps them; the tiny tokenizer does the same.
THINK_TOKENS = ("<think>", "</think>")
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, HEADER_START, HEADER_END)

# Raw string: Jinja itself turns the '\n' escapes inside its string literals into newlines.
CHAT_TEMPLATE = r"""{{- bos_token -}}
{%- if tools -%}
{{- '<|header_start|>system<|header_end|>\n\nYou may call these functions:\n' -}}
{{- tools | tojson ~ '<|eot|>' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
{%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}
{%- set expected = "' (expected system/user/assistant/tool)" -%}
{{- raise_exception("unknown role '" ~ message['role'] ~ expected) -}}
{%- endif -%}
{%- if message['content'] is not string -%}
{{- raise_exception("message " ~ loop.index ~ " has no string content") -}}
{%- endif -%}
{{- '<|header_start|>' ~ message['role'] ~ '<|header_end|>\n\n' -}}
{%- if message['role'] == 'assistant' and loop.index0 > ns.last_user
      and message.get('reasoning_content') -%}
{{- '<think>\n' ~ message['reasoning_content'] ~ '\n</think>\n\n' -}}
{%- endif -%}
{{- message['content'] -}}
{%- for call in message.get('tool_calls') or [] -%}
{%- set body = {'name': call['function']['name'], 'arguments': call['function']['arguments']} -%}
{{- '\n<tool_call>\n' ~ body | tojson ~ '\n</tool_call>' -}}
{%- endfor -%}
{{- '<|eot|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|header_start|>assistant<|header_end|>\n\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\n\n</think>\n\n' -}}
{%- endif -%}
{%- endif -%}"""

_CORPUS_SEED = 20240917
_CORPUS_SENTENCES = 12_000

_WORDS = """
the of and to in a is that for it as was with be by on not he this are or his from at which
but have an they you were her she there been one all we their has would when if so no will
more can about said out up them some could what into than its time only other new people
two may first then do any like my now over such our man me even most made after also did many
before must through back years where much your way well down should because each just those
how too little state good very make world still own see men work long get here between both
life being under never day same another know while last might us great old year off come
since against go came right used take three house use during without again place around
however home small found thought went say part once general high upon school every does
system user assistant number data model token tokens prompt response answer question problem
value result function method class return string list file line error test table query
server request
queue worker budget dataset sample length memory speed output input batch step order level
water light city country history story music river mountain market price energy science
simple early clear strong free short large young human local social public human open
explain describe compare write solve compute find show give check list choose build design
because although therefore however meanwhile moreover instead finally usually often always
""".split()

_CODE_SNIPPETS = (
    "def main():\n    return 0\n",
    "for i in range(10):\n    total += i * i\n",
    "if x is None:\n    raise ValueError('missing x')\n",
    "import json\nwith open(path) as fh:\n    data = json.load(fh)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "SELECT name, count(*) FROM users GROUP BY name ORDER BY 2 DESC;\n",
    "const items = list.filter((x) => x > 0).map((x) => x * 2);\n",
)


@dataclass(frozen=True)
class TokenizerInfo:
    """What a caller needs to know about a tokenizer without loading transformers."""

    eos_token: str
    eos_token_id: int
    vocab_size: int  # highest token id + 1, added tokens included


def _syllable_word(rng: random.Random) -> str:
    # Made-up words give the BPE merges below the word level something to learn, so text
    # outside the built-in word list still tokenizes into sensible pieces.
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"
    return "".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(1, 4)))


def _sentence(rng: random.Random) -> str:
    words = [
        _syllable_word(rng) if rng.random() < 0.15 else rng.choice(_WORDS)
        for _ in range(rng.randint(4, 18))
    ]
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 100_000)))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(".....?!:;")


def _training_corpus(seed: int = _CORPUS_SEED) -> Iterator[str]:
    rng = random.Random(seed)
    for index in range(_CORPUS_SENTENCES):
        if index % 50 == 0:
            yield rng.choice(_CODE_SNIPPETS)
        yield " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))


def _train_bpe(vocab_size: int) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(THINK_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_corpus(), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in THINK_TOKENS])
    return tokenizer


def build_tiny_tokenizer(out_dir: Path, vocab_size: int = 4096) -> Path:
    """Train and save a small byte-level BPE chat tokenizer into out_dir; fully offline.

    The same vocab_size always gives byte-identical files. Token ids: 0 pad, 1 bos, 2 eos
    (`<|eot|>`, which ends every turn), 3-4 role header markers; the think tags come last.
    """
    if vocab_size < 300:
        # 256 byte symbols plus the markers must fit, or BPE cannot encode arbitrary text.
        raise ValueError(f"vocab_size must be at least 300, got {vocab_size}")
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(vocab_size),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=32_768,
    )
    wrapped.save_pretrained(out_dir)
    logger.info("built tiny tokenizer in %s (vocab %d)", out_dir, len(wrapped))
    return out_dir


def read_tokenizer_info(tokenizer_path: str | Path,
                        trust_remote_code: bool = False) -> TokenizerInfo:
    """Read eos token, its id and the vocabulary size of a tokenizer folder.

    From a fast tokenizer's JSON files when the folder has them (no transformers needed);
    a folder without ``tokenizer.json`` (Kimi's: ``tiktoken.model`` and the checkpoint's own
    code) is loaded as the producer loads it (``load_tokenizer``, ``trust_remote_code`` as
    set). Errors are one-line TokenizerErrors naming tokenizer_path.
    """
    path = _checked_folder(tokenizer_path)
    if not (path / "tokenizer.json").is_file():
        return _info_of(load_tokenizer(path, trust_remote_code), path)
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
        spec = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
        ids = dict(spec["model"]["vocab"])
        ids.update({added["content"]: added["id"] for added in spec.get("added_tokens", [])})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TokenizerError(f"tokenizer_path {path}: cannot read the tokenizer files: "
                             f"{type(exc).__name__}: {exc}") from exc
    eos = config.get("eos_token")
    if isinstance(eos, Mapping):  # older files store AddedToken dicts
        eos = eos.get("content")
    if not isinstance(eos, str):
        raise TokenizerError(f"tokenizer_path {path}: tokenizer_config.json names no eos_token")
    if eos not in ids:
        raise TokenizerError(f"tokenizer_path {path}: eos token {eos!r} is not in the "
                             "vocabulary")
    return TokenizerInfo(eos_token=eos, eos_token_id=ids[eos], vocab_size=max(ids.values()) + 1)


def _info_of(tokenizer: Any, path: Path) -> TokenizerInfo:
    if tokenizer.eos_token_id is None:
        raise TokenizerError(f"tokenizer_path {path}: the tokenizer has no eos token")
    # len() counts added tokens too, which is what an embedding table must cover.
    return TokenizerInfo(eos_token=str(tokenizer.eos_token),
                         eos_token_id=int(tokenizer.eos_token_id), vocab_size=len(tokenizer))


class TokenizerError(ValueError):
    """The tokenizer at ``tokenizer_path`` cannot be loaded; one line naming the setting."""


# What makes a folder a tokenizer: its config plus one of the vocabulary files that
# transformers reads (fast JSON, sentencepiece, tiktoken ranks as Kimi ships them).
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")


def load_tokenizer(tokenizer_path: str | Path, trust_remote_code: bool = False) -> Any:
    """``AutoTokenizer`` from a local folder, or a one-line TokenizerError naming the setting.

    A tokenizer that is the checkpoint's own code (``auto_map`` in tokenizer_config.json, as
    Kimi-K2.x ships it) loads only with ``trust_remote_code``; nothing is downloaded.
    """
    path = _checked_folder(tokenizer_path)
    code = _custom_code(path)
    if code and not trust_remote_code:
        raise TokenizerError(
            f"tokenizer_path {path}: the tokenizer is the checkpoint's own code ({code} in "
            "tokenizer_config.json's auto_map); set trust_remote_code = true to run it")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                             trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises anything from OSError to KeyError here
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise TokenizerError(f"tokenizer_path {path}: cannot load the tokenizer: {first}"
                             ) from exc


def _checked_folder(tokenizer_path: str | Path) -> Path:
    if not str(tokenizer_path).strip():
        raise TokenizerError("tokenizer_path is not set: point it at the target model's "
                             "tokenizer folder (DATAGEN_TOKENIZER_PATH or --tokenizer)")
    path = Path(tokenizer_path).expanduser()
    if not path.is_dir():
        what = "not a folder" if path.exists() else "no such folder"
        raise TokenizerError(f"tokenizer_path {path}: {what}")
    if not (path / "tokenizer_config.json").is_file() and not (path / "tokenizer.json").is_file():
        raise TokenizerError(
            f"tokenizer_path {path}: no tokenizer files in this folder (expected "
            f"tokenizer_config.json with one of {', '.join(VOCAB_FILES)})")
    return path


def _custom_code(path: Path) -> str:
    """The class tokenizer_config.json's auto_map names for AutoTokenizer, or ""."""
    try:
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    entry = config.get("auto_map", {}).get("AutoTokenizer") if isinstance(config, dict) else None
    if isinstance(entry, list):
        entry = next((e for e in entry if e), None)
    return entry if isinstance(entry, str) else ""
