"""The tiny offline tokenizer and ChatEncoder: loading, template, batch == single, demo lengths."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from datagen.tokenization.chat import ChatEncoder, ChatTemplateError
from datagen.tokenization.tokenizer import build_tiny_tokenizer, read_tokenizer_info
from producers.reader import Prompt, discover_datasets, read_dataset

DEMO = Path(__file__).resolve().parents[3] / "data" / "demo" / "partition"
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2 = ?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! <think>x</think>"},
     {"role": "user", "content": "Café, naïve, 東京, emoji 🙂 and\ttabs\n\nnew lines"}],
    [{"role": "user", "content": "def f(x):\n    return x ** 2  # 12345678901234567890"}],
]


@pytest.fixture(scope="session")
def offline() -> Iterator[None]:
    # An unroutable endpoint makes any attempt to reach the hub fail loudly instead of downloading.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
        yield


@pytest.fixture(scope="session")
def tokenizer_dir(offline: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture(scope="session")
def encoder(tokenizer_dir: Path) -> ChatEncoder:
    return ChatEncoder(tokenizer_dir)


def test_tiny_tokenizer_loads_offline_with_autotokenizer(tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.eos_token == "<|eot|>"
    assert len(tok) <= 4096
    assert tok.chat_template


def test_info_read_from_json_matches_the_loaded_tokenizer(
    tokenizer_dir: Path, encoder: ChatEncoder
) -> None:
    info = read_tokenizer_info(tokenizer_dir)
    assert (info.eos_token, info.eos_token_id) == ("<|eot|>", encoder.eos_token_id)
    assert info.vocab_size == encoder.vocab_size <= 4096


def test_build_is_deterministic(tokenizer_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_tokenizer(tmp_path / "again")
    names = sorted(p.name for p in tokenizer_dir.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (tokenizer_dir / name).read_bytes() == (again / name).read_bytes(), name


def test_smaller_vocab_is_respected(offline: None, tmp_path: Path) -> None:
    small = build_tiny_tokenizer(tmp_path / "t", vocab_size=512)
    assert read_tokenizer_info(small).vocab_size <= 512
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_tokenizer(tmp_path / "u", vocab_size=100)


def test_template_writes_role_headers_and_generation_prompt(encoder: ChatEncoder) -> None:
    text = encoder.render(CONVERSATIONS[1])
    assert text == (
        "<|begin|><|header_start|>system<|header_end|>\n\nBe brief.<|eot|>"
        "<|header_start|>user<|header_end|>\n\n2 + 2 = ?<|eot|>"
        "<|header_start|>assistant<|header_end|>\n\n"
    )
    ids = encoder.encode(CONVERSATIONS[1])
    assert ids[0] == 1 and ids.count(encoder.eos_token_id) == 2
    assert encoder.decode(ids) == text


def test_encode_batch_gives_the_same_ids_as_encode(encoder: ChatEncoder) -> None:
    assert encoder.encode_batch(CONVERSATIONS) == [encoder.encode(c) for c in CONVERSATIONS]
    assert encoder.encode_batch([]) == []


def test_enable_thinking_false_appends_an_empty_think_block(tokenizer_dir: Path) -> None:
    default = ChatEncoder(tokenizer_dir)
    thinking = ChatEncoder(tokenizer_dir, {"enable_thinking": True})
    no_think = ChatEncoder(tokenizer_dir, {"enable_thinking": False})
    conversation = CONVERSATIONS[0]
    assert default.encode(conversation) == thinking.encode(conversation)
    assert no_think.encode(conversation) != default.encode(conversation)
    assert no_think.render(conversation).endswith("<think>\n\n</think>\n\n")
    assert no_think.encode_batch([conversation]) == [no_think.encode(conversation)]


def test_unknown_role_raises_value_error_naming_it(encoder: ChatEncoder) -> None:
    bad = [{"role": "wizard", "content": "x"}]
    with pytest.raises(ValueError, match="unknown role 'wizard'"):
        encoder.encode(bad)
    with pytest.raises(ValueError, match="conversation 1: .*unknown role 'wizard'") as caught:
        encoder.encode_batch([CONVERSATIONS[0], bad, CONVERSATIONS[1]])
    assert isinstance(caught.value, ChatTemplateError) and caught.value.index == 1


def test_empty_conversation_raises_value_error(encoder: ChatEncoder) -> None:
    with pytest.raises(ValueError):
        encoder.encode([])
    with pytest.raises(ValueError, match="conversation 0"):
        encoder.encode_batch([[]])


def test_demo_long_documents_are_longer_than_every_short_prompt(encoder: ChatEncoder) -> None:
    lengths: dict[str, list[int]] = {}
    for name, path in discover_datasets(DEMO):
        prompts = [p for p in read_dataset(name, path) if isinstance(p, Prompt)]
        lengths[name] = [len(ids) for ids in encoder.encode_batch([p.messages for p in prompts])]
    long_docs = lengths.pop("A2_longdoc")
    short = [n for values in lengths.values() for n in values]
    assert 1500 <= min(long_docs) and max(long_docs) <= 3000
    assert max(short) < 1000 < 1500 <= min(long_docs)
