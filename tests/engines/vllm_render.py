"""Prompt ids as vLLM's own chat-serving code renders them (run with .venv-vllm's python).

Reads one JSON object per line on stdin, ``{"messages", "tools"?, "chat_template_kwargs"?}``
(the body of a chat request), and writes one JSON line per request: ``{"ids": [...]}`` or
``{"error": "..."}``. Each request goes through vLLM's ``ChatCompletionRequest`` and
``OnlineRenderer.render_chat``, the renderer ``vllm serve`` and its CPU-only render server
build from the ``VllmConfig`` (tools dumped from the request's model, messages parsed by
``parse_chat_messages``, the tokenizer's template applied). Tools are allowed as a server
started with ``--enable-auto-tool-choice`` allows them; the tool parser only reads outputs.

    .venv-vllm/bin/python tests/engines/vllm_render.py MODEL_DIR TOOL_PARSER < requests.jsonl

MODEL_DIR holds the tokenizer and a ``config.json`` (vLLM's model config is built from it;
no weights are read).
"""

from __future__ import annotations

import asyncio
import json
import sys


def online_renderer(model_dir: str, tool_parser: str):
    from vllm.config import ModelConfig, VllmConfig
    from vllm.renderers import renderer_from_config
    from vllm.renderers.online_renderer import OnlineRenderer

    model_config = ModelConfig(model=model_dir, tokenizer=model_dir, trust_remote_code=True)
    config = VllmConfig(model_config=model_config)
    return OnlineRenderer(
        model_config=model_config, renderer=renderer_from_config(config),
        request_logger=None, chat_template=None, chat_template_content_format="auto",
        enable_auto_tools=True, tool_parser=tool_parser)


async def render(renderer, body: dict) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    try:
        request = ChatCompletionRequest(model=renderer.model_config.model, **body)
        result = await renderer.render_chat(request)
        if not isinstance(result, tuple):  # an ErrorResponse: the server answers 400
            return {"error": str(getattr(result, "error", result))}
        _, engine_inputs = result
        return {"ids": [int(i) for i in engine_inputs[0]["prompt_token_ids"]]}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    renderer = online_renderer(sys.argv[1], sys.argv[2])
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(asyncio.run(render(renderer, json.loads(line)))), flush=True)


if __name__ == "__main__":
    main()
