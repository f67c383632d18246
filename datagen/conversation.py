"""One conversation as a chat template reads it, from every shape chat and agent data comes in.

The reader turns each dataset line into this model; the template (``ChatEncoder``), the prompt
store and the training rows read only it. A message is OpenAI's, normalised:

    {"role": "system" | "user" | "assistant" | "tool",
     "content": str | [{"type": "text", "text": str}, ...],
     "reasoning_content": str,                       # assistant, optional (thinking)
     "tool_calls": [{"id": str, "type": "function",
                     "function": {"name": str, "arguments": {...}}}],   # assistant, optional
     "tool_call_id": str, "name"?: str,              # tool (tool_call_id always there)
     ...any other key of the input, unchanged}

Normalised as the serving engines do before they render (SGLang 0.5.23's
``normalize_assistant_tool_call_arguments`` and ``process_content_for_template_format``,
vLLM's chat utils): call arguments given as a JSON string become the object; a call-only turn's
``null`` content becomes ""; the ``reasoning`` and ``thinking`` spellings exports use become
``reasoning_content``. ShareGPT's tool roles (LLaMA-Factory, glaive) become OpenAI's:
``function_call`` an assistant turn with ``tool_calls``, ``observation`` a ``tool`` turn.
A ``null`` field is an absent one (a Hugging Face ``datasets`` export writes every field of a
struct column on every message: ``"name": null``, ``"tool_call_id": null``); ``null`` or ""
arguments are ``{}``, as both servers take them; a list of arguments is kept (vLLM takes it
as ``{}``, SGLang refuses it: ``datagen.servers.chat_request``).

Ids, the documented choice: a call without an id gets Kimi's own, ``functions.NAME:IDX``, IDX
counting the conversation's calls from 0 (what SGLang's and vLLM's ``kimi_k2`` tool parsers
give the calls a Kimi target makes, so what a client sends back in live traffic); a ``tool``
turn without a ``tool_call_id`` answers the call at its place in the run of results after
the assistant turn, and gets that call's id. A request always carries ids, so no template
renders an id the dataset left out as nothing (or as ``None``).

Refused, with the reason (``ConversationError``): media parts (an image, audio or video cannot be
generated from token ids), a ``tool`` turn with no call before it, a ``tool_call_id`` no earlier
call has, arguments that are not a JSON object, more results than calls in a run, ``tools``
that are not function specs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "function_call": "assistant", "observation": "tool",
                  "tool": "tool"}
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
TEXT_PARTS = ("text", "input_text")
MEDIA_PARTS = ("image", "image_url", "input_image", "audio", "audio_url", "input_audio",
               "video", "video_url", "file", "input_file")
# What a template reads of a message: the sample id of a record without one digests these
# (other keys may reach the template, but a chat line's id stays what it was before them).
CORE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")
# Roles a generated assistant turn may follow: the last message of a prompt.
PROMPT_ENDS = ("user", "tool")

Message = dict[str, Any]


class ConversationError(ValueError):
    """One line's conversation cannot be rendered; the message is the reason."""


def messages_of(value: Any, field: str) -> list[Message]:
    """Every turn of an OpenAI ``messages`` or a ``conversations`` list (SpecForge's or
    ShareGPT's), normalised, with the agent structure checked."""
    if not isinstance(value, list):
        raise ConversationError(f"'{field}' must be a list, got {json_type(value)}")
    if not value:
        raise ConversationError(f"empty '{field}'")
    messages = [_turn(turn, number) for number, turn in enumerate(value, start=1)]
    check_calls(messages)
    give_ids(messages)
    return messages


def tools_of(value: Any) -> list[Any] | None:
    """A record's ``tools``: a list of function specs (or a JSON string of one), as given;
    None for no tools."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        value = _loads(value, "'tools' is a string but not JSON")
    if not isinstance(value, list):
        raise ConversationError(f"'tools' must be a list of function specs, got "
                                f"{json_type(value)}")
    for number, tool in enumerate(value, start=1):
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) \
                or not spec["name"]:
            raise ConversationError(f"tools[{number}]: not a function spec (expected "
                                    "{'type': 'function', 'function': {'name', ...}})")
        if spec.get("parameters") is not None and not isinstance(spec["parameters"], dict):
            raise ConversationError(f"tools[{number}] ({spec['name']}): 'parameters' must be "
                                    f"an object, got {json_type(spec['parameters'])}")
    return value or None


def _turn(turn: Any, number: int) -> Message:
    if not isinstance(turn, dict):
        raise ConversationError(f"turn {number}: expected an object, got {json_type(turn)}")
    if "from" in turn:
        return _sharegpt_turn(turn, number)
    if "role" not in turn or ("content" not in turn and "tool_calls" not in turn):
        raise ConversationError(f"turn {number}: needs 'role' and 'content'")
    role = turn["role"]
    if not isinstance(role, str) or role not in ROLES:
        raise ConversationError(f"turn {number}: unknown role {role!r} (expected one of "
                                f"{', '.join(ROLES)})")
    message = {k: v for k, v in turn.items() if k not in REASONING_KEYS and v is not None}
    reasoning = _reasoning(turn, number)
    if reasoning is not None:
        if role != "assistant":
            raise ConversationError(f"turn {number}: reasoning on a {role!r} turn")
        message["reasoning_content"] = reasoning
    if "tool_calls" in turn and turn["tool_calls"] is not None:
        if role != "assistant":
            raise ConversationError(f"turn {number}: tool_calls on a {role!r} turn")
        message["tool_calls"] = _calls(turn["tool_calls"], number)
    else:
        message.pop("tool_calls", None)
    message["content"] = _content(turn.get("content"), number, role,
                                  bool(message.get("tool_calls")) or reasoning is not None)
    for key in ("tool_call_id", "name"):
        if key in message and not isinstance(message[key], str):
            raise ConversationError(f"turn {number}: '{key}' must be a string, got "
                                    f"{json_type(message[key])}")
    return message


def _sharegpt_turn(turn: dict[str, Any], number: int) -> Message:
    role, value = turn.get("from"), turn.get("value")
    if not isinstance(role, str) or role not in SHAREGPT_ROLES:
        raise ConversationError(f"turn {number}: unknown role {role!r} (expected one of "
                                f"{', '.join(SHAREGPT_ROLES)})")
    if "value" not in turn:
        raise ConversationError(f"turn {number}: needs 'from' and 'value'")
    if role == "function_call":
        return {"role": "assistant", "content": "", "tool_calls": _sharegpt_calls(value, number)}
    if not isinstance(value, str):
        raise ConversationError(f"turn {number}: content must be a string, got "
                                f"{json_type(value)}")
    return {"role": SHAREGPT_ROLES[role], "content": value}


def _sharegpt_calls(value: Any, number: int) -> list[dict[str, Any]]:
    """LLaMA-Factory's ``function_call`` value: a JSON string of {"name", "arguments"} or a
    list of them (parallel calls)."""
    calls = _loads(value, f"turn {number}: function_call is not JSON") \
        if isinstance(value, str) else value
    calls = calls if isinstance(calls, list) else [calls]
    return _calls([{"type": "function", "function": c} if isinstance(c, dict) else c
                   for c in calls], number)


def _calls(value: Any, number: int) -> list[dict[str, Any]]:
    if isinstance(value, str):
        value = _loads(value, f"turn {number}: tool_calls is a string but not JSON")
    if not isinstance(value, list):
        raise ConversationError(f"turn {number}: tool_calls must be a list, got "
                                f"{json_type(value)}")
    return [_call(call, number, index) for index, call in enumerate(value, start=1)]


def _call(call: Any, number: int, index: int) -> dict[str, Any]:
    where = f"turn {number}: tool call {index}"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not function["name"]:
        raise ConversationError(f"{where}: expected {{'function': {{'name', 'arguments'}}}}")
    arguments = function.get("arguments")
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        arguments = _loads(arguments, f"{where} ({function['name']}): arguments are not JSON") \
            if arguments.strip() else {}
    if not isinstance(arguments, (dict, list)):
        raise ConversationError(f"{where} ({function['name']}): arguments must be a JSON "
                                f"object, got {json_type(arguments)}")
    out = {k: v for k, v in call.items() if k != "function" and v is not None}
    out.setdefault("type", "function")
    if "id" in out and not isinstance(out["id"], str):
        raise ConversationError(f"{where}: 'id' must be a string, got {json_type(out['id'])}")
    out["function"] = {**function, "arguments": arguments}
    return out


def _loads(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConversationError(f"{what}: {exc.msg} (col {exc.colno})") from None


def _reasoning(turn: dict[str, Any], number: int) -> str | None:
    found = [(key, turn[key]) for key in REASONING_KEYS if turn.get(key) is not None]
    for key, value in found:
        if not isinstance(value, str):
            raise ConversationError(f"turn {number}: '{key}' must be a string, got "
                                    f"{json_type(value)}")
    if len({value for _, value in found}) > 1:
        raise ConversationError(f"turn {number}: {' and '.join(k for k, _ in found)} differ")
    return found[0][1] if found else None


def _content(content: Any, number: int, role: str, may_be_empty: bool) -> str | list[Any]:
    if content is None:
        if (role == "assistant" and may_be_empty) or role in ("system", "tool"):
            return ""  # a call-only turn, an empty result: both servers render null as ""
        raise ConversationError(f"turn {number}: content is null")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ConversationError(f"turn {number}: content must be a string or a list of "
                                f"parts, got {json_type(content)}")
    parts = []
    for index, part in enumerate(content, start=1):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise ConversationError(f"turn {number}: part {index} is {kind!r}: media cannot be "
                                    "generated from token ids")
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ConversationError(f"turn {number}: part {index} is not a text part "
                                    "({'type': 'text', 'text': str})")
        parts.append({"type": "text", "text": part["text"]})
    return parts


def check_calls(messages: Sequence[Mapping[str, Any]]) -> None:
    """A ``tool`` turn answers a call of the assistant turn before it (after other results of
    the same turn): one of its ``tool_calls`` or, without them, a call written in its text
    (Hermes' ``<tool_call>``, ToolACE's ``[f(x=1)]``); its ``tool_call_id``, where both sides
    have ids, is one of those calls'."""
    open_ids: set[str] | None = None  # the calls a tool turn may answer now
    for number, message in enumerate(messages, start=1):
        role = message["role"]
        if role == "assistant":
            calls = message.get("tool_calls") or []
            open_ids = {c["id"] for c in calls if c.get("id")}
            if not calls and not text_of(message.get("content") or "").strip():
                open_ids = None  # no call, not even one written as text (Hermes, ToolACE)
        elif role == "tool":
            if open_ids is None:
                raise ConversationError(f"turn {number}: a 'tool' turn with no tool call "
                                        "before it")
            call_id = message.get("tool_call_id")
            if call_id and open_ids and call_id not in open_ids:
                raise ConversationError(f"turn {number}: tool_call_id {call_id!r} answers no "
                                        "call of the assistant turn before it")
        else:
            open_ids = None


def give_ids(messages: Sequence[dict[str, Any]]) -> None:
    """Kimi's ids (``functions.NAME:IDX``) for calls without one, and to each result without
    a ``tool_call_id`` the id of the call at its place in its run of results (a result of a
    call written as text has no id to get)."""
    count, calls, answered = 0, [], 0
    for number, message in enumerate(messages, start=1):
        if message["role"] == "assistant":
            calls, answered = message.get("tool_calls") or [], 0
            for call in calls:
                call.setdefault("id", f"functions.{call['function']['name']}:{count}")
                count += 1
        elif message["role"] == "tool" and calls:
            if "tool_call_id" not in message:
                if answered >= len(calls):
                    raise ConversationError(f"turn {number}: a result without a tool_call_id "
                                            f"after all {len(calls)} calls were answered")
                message["tool_call_id"] = calls[answered]["id"]
            answered += 1


def text_of(content: str | Sequence[Mapping[str, Any]]) -> str:
    """A message's text: the string, or its text parts joined as SGLang joins them for a
    template that reads strings (``process_content_for_template_format``: one space)."""
    if isinstance(content, str):
        return content
    return " ".join(part["text"] for part in content)


def core(message: Mapping[str, Any]) -> dict[str, Any]:
    return {key: message[key] for key in CORE_KEYS if key in message}


def event_cuts(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Where a generated assistant turn may start: the index of each assistant turn that
    follows a user or tool turn, then the end when the conversation ends on one. The prompt
    of a cut is ``messages[:cut]``."""
    cuts = [i for i, m in enumerate(messages)
            if m["role"] == "assistant" and i and messages[i - 1]["role"] in PROMPT_ENDS]
    if messages and messages[-1]["role"] in PROMPT_ENDS:
        cuts.append(len(messages))
    return cuts


def json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")
