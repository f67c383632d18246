"""What a server hands the chat template for the chat request a conversation makes.

A drafter must learn on the prompts the target is served, and a served prompt is the template
applied to the server's own view of the request, not to the dataset line. Between the two,
each server normalises: it validates the request into its pydantic models and dumps them,
drops or fills fields, joins text parts. ``RENDERINGS[kind](messages, tools, template)`` does
what that kind does, on the conversation model of ``datagen.conversation`` (arguments already
objects, ids already given), and returns the messages and tools its template call receives.

Read from the installed engines' source (the tests run the same requests through it):

SGLang 0.5.23 (``entrypoints/openai/protocol.py``, ``serving_chat.py`` ``_apply_jinja_template``,
``parser/jinja_template_utils.py``):
  - a tool is its ``Tool`` model's dump: ``{"type", "function": {...}, "defer_loading": None}``;
    the function keeps the keys it was given, in their order, then ``description`` and
    ``parameters`` (None) where missing; ``strict`` only where given; other keys dropped.
  - a user message is ``{"role", "content"}`` (its model has no ``name``); another message
    keeps ``content``, ``tool_call_id``, ``name``, ``reasoning_content``, ``tool_calls``;
    None-valued keys are dropped, other keys are dropped by the model.
  - a call is ``{"id", "index": None, "type", "function": {"name", "arguments"}}``; list
    arguments are refused (the model takes a string or an object).
  - parts reach a template that loops over ``message['content']`` (or names a medium) as
    ``[{"type": "text", "text"}]``; any other gets them joined by one space. A ``tool``
    message's text parts are joined by one space whatever the template.

vLLM 0.32 (``entrypoints/openai/chat_completion/protocol.py``, ``renderers/chat_utils.py``
``_parse_chat_message_content`` and ``_postprocess_messages``, ``renderers/hf.py``
``_detect_content_format``):
  - a tool is ``{"type": "function", "function": {"name", "description", "parameters"}}`` in
    that order (None where missing), ``strict`` and ``defer_loading`` only where given.
  - every message is rebuilt: ``role``, ``content``, and ``tool_calls``, ``reasoning`` and
    ``reasoning_content`` (assistant), ``tool_call_id`` (tool), ``name`` where a string.
  - content: for a template that loops over content parts every content becomes a list of
    ``{"type": "text", "text"}`` (a string one part); for any other, parts are joined by a
    newline. A ``tool`` message's text parts are joined by a newline.
  - call arguments that are None, "" or not an object become ``{}``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from datagen.servers.content_format import sglang_content_format, vllm_content_format

Message = dict[str, Any]
Rendering = Callable[[Sequence[Mapping[str, Any]], Sequence[Any] | None, str],
                     tuple[list[Message], list[dict[str, Any]] | None]]


class RequestRefused(ValueError):
    """The server would answer this chat request with a 400; the message says why."""


def function_spec(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The function of a tool: a bare spec (glaive, LLaMA-Factory) is its own function,
    which a client sends wrapped as ``{"type": "function", "function": spec}``."""
    function = tool.get("function")
    return dict(function) if isinstance(function, Mapping) else dict(tool)


# --- SGLang 0.5.23 --------------------------------------------------------------------------

SGLANG_FUNCTION_FIELDS = ("description", "name", "parameters", "strict", "defer_loading")
SGLANG_KEEPS = ("content", "tool_call_id", "name", "reasoning_content", "tool_calls")


def sglang_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    spec = function_spec(tool)
    wrapper_defer = tool.get("defer_loading") if "function" in tool else None
    if spec.get("defer_loading") is None and wrapper_defer is not None:
        spec["defer_loading"] = wrapper_defer
    given = [key for key in spec if key in SGLANG_FUNCTION_FIELDS]
    dumped = {key: spec.get(key) for key in SGLANG_FUNCTION_FIELDS}
    for key in ("strict", "defer_loading"):
        if dumped[key] is None:
            del dumped[key]
    function = {key: dumped[key] for key in [*given, *dumped] if key in dumped}
    return {"type": tool.get("type", "function") if "function" in tool else "function",
            "function": function, "defer_loading": wrapper_defer}


def sglang_call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call["function"]
    if not isinstance(function["arguments"], dict):
        raise RequestRefused(f"tool call {function['name']}: SGLang takes arguments as a "
                             "JSON string or object, not a list")
    return {"id": call.get("id"), "index": call.get("index"), "type": "function",
            "function": {"name": function["name"], "arguments": function["arguments"]}}


def sglang_message(message: Mapping[str, Any], content_format: str) -> Message:
    keys = SGLANG_KEEPS if message["role"] != "user" else ("content",)
    out: Message = {"role": message["role"]}
    out.update((key, message[key]) for key in keys if message.get(key) is not None)
    if "tool_calls" in out:
        out["tool_calls"] = [sglang_call(call) for call in out["tool_calls"]]
    content = out.get("content", "")
    if isinstance(content, list) and (content_format == "string" or out["role"] == "tool"):
        content = " ".join(part["text"] for part in content)
    out["content"] = content
    return out


# --- vLLM 0.32 ------------------------------------------------------------------------------


def vllm_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    spec = function_spec(tool)
    function = {"name": spec["name"], "description": spec.get("description"),
                "parameters": spec.get("parameters")}
    wrapper_defer = tool.get("defer_loading") if "function" in tool else None
    for key in ("strict", "defer_loading"):
        value = spec.get(key)
        if key == "defer_loading" and value is None:
            value = wrapper_defer
        if value is not None:
            function[key] = value
    return {"type": "function", "function": function}


def vllm_call(call: Mapping[str, Any]) -> dict[str, Any]:
    function = call["function"]
    arguments = function["arguments"] if isinstance(function["arguments"], dict) else {}
    return {"id": call.get("id"), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def vllm_message(message: Mapping[str, Any], content_format: str) -> Message:
    role, content = message["role"], message.get("content")
    texts = [content] if isinstance(content, str) else [p["text"] for p in content or []]
    if content_format == "openai" and role != "tool":
        out: Message = {"role": role, "content": [{"type": "text", "text": t} for t in texts]}
    elif content_format == "openai":  # a tool result's parts, flattened after parsing
        out = {"role": role, "content": "\n".join(texts)}
    else:  # parsing drops empty texts before it joins them
        out = {"role": role, "content": "\n".join(t for t in texts if t)}
    if role == "assistant":
        if message.get("tool_calls"):
            out["tool_calls"] = [vllm_call(call) for call in message["tool_calls"]]
        if message.get("reasoning_content") is not None:
            out["reasoning"] = out["reasoning_content"] = message["reasoning_content"]
    if role == "tool" and "tool_call_id" in message:
        out["tool_call_id"] = message["tool_call_id"]
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def rendering(detect: Callable[[str], str], message: Callable[[Mapping[str, Any], str], Message],
              tool: Callable[[Mapping[str, Any]], dict[str, Any]]) -> Rendering:
    """A server's rendering: its content-format detector, its message and its tool rules."""
    def render(messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None,
               template: str) -> tuple[list[Message], list[dict[str, Any]] | None]:
        content_format = detect(template)
        return ([message(m, content_format) for m in messages],
                [tool(t) for t in tools] if tools else None)
    return render


RENDERINGS: dict[str, Rendering] = {
    "sglang": rendering(sglang_content_format, sglang_message, sglang_tool),
    "vllm": rendering(vllm_content_format, vllm_message, vllm_tool)}
# Where each server's answers put the reasoning, so where a client sends it back.
REASONING_FIELDS = {"sglang": "reasoning_content", "vllm": "reasoning"}


def request_body(kind: str, messages: Sequence[Mapping[str, Any]],
                 tools: Sequence[Any] | None,
                 template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The body of the chat request a conversation makes to a server of ``kind``: what
    ``/v1/chat/completions`` (and ``/tokenize``) take. Tools are wrapped as a client must
    send them; reasoning goes under the field that server's answers use."""
    field = REASONING_FIELDS[kind]
    body: dict[str, Any] = {"messages": [
        {(field if key == "reasoning_content" else key):
         [_sent_call(call) for call in value] if key == "tool_calls" else value
         for key, value in m.items()} for m in messages]}
    if tools:
        body["tools"] = [{"type": "function", "function": function_spec(t)}
                         if "function" not in t else dict(t) for t in tools]
    if template_kwargs:
        body["chat_template_kwargs"] = dict(template_kwargs)
    return body


def _sent_call(call: Mapping[str, Any]) -> dict[str, Any]:
    """A call as the OpenAI API sends it: its arguments a JSON string."""
    function = call["function"]
    return {**call, "function": {**function, "arguments": json.dumps(
        function["arguments"], ensure_ascii=False)}}
