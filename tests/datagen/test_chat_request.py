"""The prompt is what the configured server renders for the chat request a line makes.

Every line of the agent corpus (``tests/fixtures/agent_corpus``, public shapes, sources in its
README) is read as the producer reads it; each generation event's chat request goes to SGLang
0.5.23's and vLLM 0.32's own chat-serving code (``tests/engines/*_render.py``, run in their
venvs: no re-implementation stands in) and the ids they produce must equal the producer's
``ChatEncoder`` ids for that ``server_kind``. Two templates: Kimi-K2.5's published
``chat_template.jinja`` (checked by its sha256) with the demo's Kimi-style custom-code
tokenizer, whose own ``apply_chat_template`` sorts the tools and declares them TypeScript
style, and a Qwen3-style template with the tiny fast tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from datagen.builders.tiktoken_fixture import build_tiktoken_tokenizer
from datagen.servers.chat_request import RENDERINGS, RequestRefused, request_body
from datagen.tokenization.chat import ChatEncoder
from datagen.tokenization.tokenizer import build_tiny_tokenizer
from producers.reader import BadRecord, read_dataset

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
CORPUS = FIXTURES / "agent_corpus"
KIMI_K25_TEMPLATE = FIXTURES / "templates" / "kimi_k25_chat_template.jinja"
KIMI_K25_SHA256 = "7c91e4b3578b518bfb388d2e3dc645daf0fbf843656e887db75d12891e0030ff"
QWEN3_TEMPLATE = FIXTURES / "templates" / "qwen3_style_chat_template.jinja"
TEMPLATES = {"kimi": KIMI_K25_TEMPLATE, "qwen": QWEN3_TEMPLATE}
ENGINES = {"sglang": (ROOT / ".venv-sglang" / "bin" / "python", "sglang_render.py"),
           "vllm": (ROOT / ".venv-vllm" / "bin" / "python", "vllm_render.py")}
TOOL_PARSERS = {"kimi": "kimi_k2", "qwen": "hermes"}
# vLLM builds its model config from config.json (no weights are read).
MODEL_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                "num_key_value_heads": 4, "num_hidden_layers": 1, "vocab_size": 4200,
                "max_position_embeddings": 8192, "torch_dtype": "float32"}


def corpus_events() -> list[tuple[str, tuple[Any, ...], tuple[Any, ...] | None]]:
    """Every generation event of every corpus line: (where, messages, tools)."""
    events = []
    for file in sorted(CORPUS.glob("*.jsonl")):
        for item in read_dataset(file.stem, file):
            assert not isinstance(item, BadRecord), str(item)
            events += [(f"{item.source} event {n}", event.messages, event.tools)
                       for n, event in enumerate(item.events(), start=1)]
    return events


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    assert hashlib.sha256(KIMI_K25_TEMPLATE.read_bytes()).hexdigest() == KIMI_K25_SHA256
    out = tmp_path_factory.mktemp("tokenizers")
    kimi = build_tiktoken_tokenizer(out / "kimi", chat_template=KIMI_K25_TEMPLATE.read_text(
        encoding="utf-8"))
    qwen = build_tiny_tokenizer(out / "qwen")
    (qwen / "chat_template.jinja").write_bytes(QWEN3_TEMPLATE.read_bytes())
    for folder in (kimi, qwen):
        (folder / "config.json").write_text(json.dumps(MODEL_CONFIG), encoding="utf-8")
    return {"kimi": kimi, "qwen": qwen}


def engine_ids(kind: str, tokenizer: str, folder: Path,
               bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the server's own rendering code answers for each request body."""
    python, script = ENGINES[kind]
    if not python.exists():
        pytest.fail(f"{python} is missing: the engine venvs are built by make install")
    args = [str(python), str(ROOT / "tests" / "engines" / script), str(folder)]
    if kind == "vllm":
        args.append(TOOL_PARSERS[tokenizer])
    done = subprocess.run(args, input="".join(json.dumps(b) + "\n" for b in bodies),
                          capture_output=True, text=True, timeout=900, cwd=folder,
                          env={**os.environ, "PYTHONPATH": "", "VLLM_LOGGING_LEVEL": "ERROR"})
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(answers) == len(bodies), done.stderr[-4000:]
    return answers


@pytest.mark.parametrize("tokenizer", ["kimi", "qwen"])
@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_every_corpus_prompt_is_the_ids_the_servers_own_code_renders(
        tokenizers: dict[str, Path], kind: str, tokenizer: str) -> None:
    events = corpus_events()
    template_kwargs = {"thinking": True} if tokenizer == "kimi" else {"enable_thinking": True}
    encoder = ChatEncoder(tokenizers[tokenizer], template_kwargs, trust_remote_code=True,
                          server_kind=kind)
    assert encoder.template == TEMPLATES[tokenizer].read_text(encoding="utf-8")
    bodies = [request_body(kind, messages, tools, template_kwargs)
              for _, messages, tools in events]
    answers = engine_ids(kind, tokenizer, tokenizers[tokenizer], bodies)
    differ = []
    for (where, messages, tools), answer in zip(events, answers, strict=True):
        assert "ids" in answer, f"{where}: the server refused the request: {answer}"
        ours = encoder.encode(list(messages), tools)
        if ours != answer["ids"]:
            at = next((i for i, (a, b) in enumerate(zip(ours, answer["ids"], strict=False))
                       if a != b), min(len(ours), len(answer["ids"])))
            differ.append(f"{where}: first difference at token {at}:\n  ours:   "
                          f"{encoder.decode(ours[at:at + 40])!r}\n  server: "
                          f"{encoder.decode(answer['ids'][at:at + 40])!r}")
    assert not differ, f"{len(differ)} of {len(events)} prompts differ:\n" + "\n".join(differ)


def test_the_corpus_covers_every_shape_the_issue_names() -> None:
    shapes = {file.stem for file in CORPUS.glob("*.jsonl")}
    assert shapes == {"glaive_sharegpt", "xlam_apigen", "hermes", "toolace",
                      "openai_datasets_export", "specforge"}
    assert len(corpus_events()) >= 15


if __name__ == "__main__":  # debugging: print one kind's differences
    sys.exit(pytest.main([__file__, "-x", "-q"]))


# --- each rule on its own (the corpus test above holds them against the engines) -----------

SPEC = {"name": "f", "parameters": {"type": "object", "properties": {}}}


def test_a_bare_spec_is_wrapped_and_dumped_as_each_servers_tool_model_dumps_it() -> None:
    (sglang_tool,) = RENDERINGS["sglang"]([], [SPEC], "")[1]
    (vllm_tool,) = RENDERINGS["vllm"]([], [SPEC], "")[1]
    # SGLang keeps the given order, adds the missing description, and its wrapper's field
    assert list(sglang_tool["function"].items()) == [
        ("name", "f"), ("parameters", SPEC["parameters"]), ("description", None)]
    assert sglang_tool["defer_loading"] is None and sglang_tool["type"] == "function"
    # vLLM dumps its fields in its own order
    assert list(vllm_tool["function"]) == ["name", "description", "parameters"]
    assert vllm_tool == {"type": "function", "function": {
        "name": "f", "description": None, "parameters": SPEC["parameters"]}}


def test_user_names_tool_parts_and_list_arguments_follow_the_configured_server() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    chat = [{"role": "user", "content": "q", "name": "bob"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "functions.f:0", "type": "function",
                 "function": {"name": "f", "arguments": {}}}]},
            {"role": "tool", "content": parts, "tool_call_id": "functions.f:0"}]
    sglang, _ = RENDERINGS["sglang"](chat, None, "")
    vllm, _ = RENDERINGS["vllm"](chat, None, "")
    assert sglang[0] == {"role": "user", "content": "q"}  # SGLang's user model has no name
    assert vllm[0] == {"role": "user", "content": "q", "name": "bob"}
    assert (sglang[2]["content"], vllm[2]["content"]) == ("a b", "a\nb")
    assert sglang[1]["tool_calls"][0] == {"id": "functions.f:0", "index": None,
                                          "type": "function",
                                          "function": {"name": "f", "arguments": {}}}
    chat[1]["tool_calls"][0]["function"]["arguments"] = [1, 2]
    assert RENDERINGS["vllm"](chat, None, "")[0][1]["tool_calls"][0]["function"][
        "arguments"] == {}
    with pytest.raises(RequestRefused, match="not a list"):
        RENDERINGS["sglang"](chat, None, "")


def test_a_server_kind_with_no_rendering_is_refused(tokenizers: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="server_kind 'tgi'"):
        ChatEncoder(tokenizers["qwen"], server_kind="tgi")
