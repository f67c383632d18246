"""A Kimi-style tokenizer that is the checkpoint's own code, and the tokenizer_path errors.

conftest.py sets HF_HUB_OFFLINE, and every load is local_files_only: nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from config.settings import load_settings
from datagen.builders.tiktoken_fixture import CLASS_NAME, MODULE_NAME, build_tiktoken_tokenizer
from datagen.tokenization.chat import ChatEncoder
from datagen.tokenization.tokenizer import TokenizerError, build_tiny_tokenizer, read_tokenizer_info

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Explain the budget of a dataset, please."}]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiktoken_tokenizer(tmp_path_factory.mktemp("kimi") / "tok")


def test_the_fixture_has_the_structure_of_a_custom_code_checkpoint(kimi_dir: Path) -> None:
    config = json.loads((kimi_dir / "tokenizer_config.json").read_text())
    assert config["auto_map"]["AutoTokenizer"][0] == f"{MODULE_NAME}.{CLASS_NAME}"
    assert (kimi_dir / f"{MODULE_NAME}.py").is_file()
    assert (kimi_dir / "tiktoken.model").is_file()
    assert not (kimi_dir / "tokenizer.json").exists()  # nothing a fast tokenizer could read
    encoder = ChatEncoder(kimi_dir, trust_remote_code=True)
    tok = encoder._tokenizer
    assert type(tok).__name__ == CLASS_NAME
    assert type(tok.model).__module__.startswith("tiktoken")
    assert tok.eos_token == "<|im_end|>"
    assert encoder.eos_token_id == tok.special_tokens["<|im_end|>"]


def test_it_loads_only_with_trust_remote_code(kimi_dir: Path) -> None:
    with pytest.raises(TokenizerError) as info:
        ChatEncoder(kimi_dir)
    message = str(info.value)
    assert "\n" not in message
    assert "trust_remote_code = true" in message and "tokenizer_path" in message
    assert f"{MODULE_NAME}.{CLASS_NAME}" in message


def test_the_producer_passes_the_setting_to_the_tokenizer(kimi_dir: Path) -> None:
    settings = load_settings(None, env={"DATAGEN_TOKENIZER_PATH": str(kimi_dir),
                                        "DATAGEN_TRUST_REMOTE_CODE": "true"})
    assert settings.trust_remote_code is True
    encoder = ChatEncoder(settings.tokenizer_path, {"thinking": False},
                          settings.trust_remote_code)
    assert encoder.render(CHAT[1:]).endswith("<think></think>")
    assert load_settings(None, env={}).trust_remote_code is False  # off by default


def test_thinking_switch_changes_only_the_generation_prompt(kimi_dir: Path) -> None:
    thinking = ChatEncoder(kimi_dir, {"thinking": True}, trust_remote_code=True)
    default = ChatEncoder(kimi_dir, trust_remote_code=True)
    instant = ChatEncoder(kimi_dir, {"thinking": False}, trust_remote_code=True)
    special = thinking._tokenizer.special_tokens

    on, off = thinking.encode(CHAT), instant.encode(CHAT)
    assert default.encode(CHAT) == on  # thinking is on unless the kwargs turn it off
    # The two prompts are the same ids up to the end of <think>; "off" closes it at once.
    assert off == on + [special["</think>"]]
    turn = thinking._tokenizer("<|im_assistant|>assistant<|im_middle|><think>",
                               add_special_tokens=False)["input_ids"]
    assert on[-len(turn):] == turn and turn[-1] == special["<think>"]
    assert thinking.render(CHAT) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Explain the budget of a dataset, please.<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>")
    # Batched and single tokenization agree, and the text round-trips.
    assert instant.encode_batch([CHAT, CHAT[1:]]) == [off, instant.encode(CHAT[1:])]
    assert instant.decode(off) == instant.render(CHAT)


def test_unset_tokenizer_path_is_one_line_naming_the_setting() -> None:
    with pytest.raises(TokenizerError, match=r"^tokenizer_path is not set: ") as info:
        ChatEncoder("")
    assert "\n" not in str(info.value)


def test_a_missing_folder_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(TokenizerError) as info:
        ChatEncoder(missing)
    assert str(info.value) == f"tokenizer_path {missing}: no such folder"


def test_a_folder_without_tokenizer_files_is_one_line_naming_the_setting(
        tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError) as info:
        ChatEncoder(tmp_path)
    message = str(info.value)
    assert message.startswith(f"tokenizer_path {tmp_path}: no tokenizer files in this folder")
    assert "\n" not in message


def test_a_broken_tokenizer_folder_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "NoSuchTokenizer"}')
    with pytest.raises(TokenizerError) as info:
        ChatEncoder(tmp_path)
    message = str(info.value)
    assert message.startswith(f"tokenizer_path {tmp_path}: cannot load the tokenizer: ")
    assert "\n" not in message


def test_an_ordinary_tokenizer_needs_no_trust(tmp_path: Path) -> None:
    tiny = build_tiny_tokenizer(tmp_path / "tiny", vocab_size=512)
    assert ChatEncoder(tiny).encode(CHAT[1:])


def test_tokenizer_info_of_a_folder_without_tokenizer_json_comes_from_its_code(
        kimi_dir: Path, tmp_path: Path) -> None:
    # Given: Kimi's shape (tiktoken.model and the checkpoint's own code, no tokenizer.json)
    # When / Then: the info the local trial gives the simulator is the producer's tokenizer's
    info = read_tokenizer_info(kimi_dir, trust_remote_code=True)
    encoder = ChatEncoder(kimi_dir, trust_remote_code=True)
    assert (info.eos_token, info.eos_token_id) == ("<|im_end|>", encoder.eos_token_id)
    assert info.vocab_size == encoder.vocab_size
    # ... and without trust_remote_code, or in a folder with no tokenizer, one line naming
    # the setting instead of a FileNotFoundError
    with pytest.raises(TokenizerError, match="tokenizer_path .*trust_remote_code"):
        read_tokenizer_info(kimi_dir)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="tokenizer_path .*no tokenizer files"):
        read_tokenizer_info(tmp_path / "empty")
