"""Prompt ids as SGLang's own chat-serving code renders them (run with .venv-sglang's python).

Reads one JSON object per line on stdin, ``{"messages", "tools"?, "chat_template_kwargs"?}``
(the body of a chat request), and writes one JSON line per request: ``{"ids": [...]}`` or
``{"error": "..."}``. Each request goes through ``ChatCompletionRequest`` (the server's
pydantic model) and ``OpenAIServingChat._process_messages``, the path ``/v1/chat/completions``
and ``/tokenize`` with ``messages`` take, with the template manager loading the tokenizer's
template as the server does at start-up. Only the tokenizer manager is stood in for: it holds
the tokenizer SGLang's own ``get_tokenizer`` loads and answers no parser is configured.

    .venv-sglang/bin/python tests/engines/sglang_render.py TOKENIZER_DIR < requests.jsonl
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace


def serving_chat(tokenizer_dir: str):
    from sglang.srt.entrypoints.openai import serving_chat as serving_module
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.srt.parser.template_manager import TemplateManager
    from sglang.srt.utils.hf_transformers.tokenizer import get_tokenizer
    from transformers import AutoConfig

    tokenizer = get_tokenizer(tokenizer_dir, trust_remote_code=True)
    try:
        hf_config = AutoConfig.from_pretrained(tokenizer_dir, trust_remote_code=True)
    except (OSError, ValueError):
        hf_config = SimpleNamespace(architectures=[], model_type="")
    manager = SimpleNamespace(
        tokenizer=tokenizer, processor=None, server_args=None, served_model_name="target",
        model_config=SimpleNamespace(hf_config=hf_config,
                                     get_default_sampling_params=lambda: None),
        config_value=lambda key: None)
    # The server's start-up publishes its arguments; the chat path reads one of them.
    serving_module.get_serving = lambda: SimpleNamespace(default_chat_template_kwargs={})
    templates = TemplateManager()
    templates.load_chat_template(manager, None, tokenizer_dir)
    return OpenAIServingChat(manager, templates)


def main() -> None:
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    chat = serving_chat(sys.argv[1])
    for line in sys.stdin:
        if not line.strip():
            continue
        body = json.loads(line)
        try:
            request = ChatCompletionRequest(model="target", **body)
            result = chat._process_messages(request, is_multimodal=False)
            out = {"ids": [int(i) for i in result.prompt_ids]}
        except Exception as exc:  # the server answers 400 with this message
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
