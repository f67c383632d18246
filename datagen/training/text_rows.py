"""The text rows (``conversations.jsonl``) for SpecForge's online path, checked against the ids.

A row is the conversation as SpecForge's parser reads it (``specforge/data/parse.py``): the
recorded history as the producer rendered it (``tool_calls``, ``tool`` turns, ``name``,
``tool_call_id``, ``reasoning_content``), the record's ``tools``, and the generated turn
parsed back into a message: its reasoning (before ``</think>``), its text and its calls (Kimi's
``<|tool_calls_section_begin|>…`` markers, or Qwen's ``<tool_call>`` JSON).

Never trusted: the row is rendered again with the chat template and tokenized, and only when
that gives exactly the sample's ids (``prompt_ids + output_ids``) is it written as parsed
(``exact``). Otherwise, a generated turn the parse cannot rebuild (a truncated turn, a call
whose JSON the template would write otherwise), the turn is written as its decoded text, as
before, and counted ``inexact``: the pre-tokenized rows (``specforge_prompts.jsonl``) are the
exact path for it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from datagen.generation.records import loss_spans

KIMI_SECTION = re.compile(r"<\|tool_calls_section_begin\|>(.*?)<\|tool_calls_section_end\|>\Z",
                          re.DOTALL)
KIMI_CALL = re.compile(r"<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)"
                       r"<\|tool_call_end\|>", re.DOTALL)
KIMI_ID = re.compile(r"(?:functions\.)?(.+?)(?::\d+)?\Z")
QWEN_CALL = re.compile(r"\n<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


@dataclass
class TextRows:
    """Writes one text row per record; ``encoder`` is the producer's ``ChatEncoder``."""

    encoder: Any
    exact: int = 0
    inexact: int = 0

    def __post_init__(self) -> None:
        self._eos = self.encoder.decode([self.encoder.eos_token_id])  # once, not per row

    def line(self, record: dict[str, Any]) -> str:
        ids = record["prompt_ids"] + record["output_ids"]
        spans = loss_spans(record) or [[len(record["prompt_ids"]), len(ids)]]
        history = [dict(m) for m in record.get("messages", [])]
        tools = record.get("tools")
        turn = self._exact_turn(history, tools, ids, spans)
        if turn is not None:
            self.exact += 1
        else:
            self.inexact += 1
            turn = {"role": "assistant", "content": self._text(ids[slice(*spans[-1])])}
            # regenerate = "all": the earlier assistant turns are the generated ones
            generated = iter(self._text(ids[a:b]) for a, b in spans[:-1])
            history = [{**m, "content": next(generated, m["content"])}
                       if m["role"] == "assistant" else m for m in history]
        row: dict[str, Any] = {"id": str(record["id"]), "conversations": [*history, turn]}
        if tools:
            row["tools"] = tools
        return json.dumps(row, ensure_ascii=False) + "\n"

    def _exact_turn(self, history: list[dict[str, Any]], tools: Any, ids: list[int],
                    spans: Sequence[Sequence[int]]) -> dict[str, Any] | None:
        if len(spans) > 1:
            return None  # regenerate = "all": several generated turns, written as text
        start, end = spans[-1]
        text = self.encoder.decode(ids[start:end])
        if text.endswith(self._eos):
            text = text[:-len(self._eos)]
        for turn in candidates(text):
            try:
                rendered = self.encoder.render_conversation([*history, turn], tools)
            except ValueError:
                continue
            if self.encoder.tokens(rendered) == ids:
                return turn
        return None

    def _text(self, ids: Sequence[int]) -> str:
        # special tokens (eos, role markers) are the template's, not the assistant's text
        return self.encoder.decode(ids, skip_special_tokens=True)


def candidates(text: str) -> Iterator[dict[str, Any]]:
    """The assistant messages a generated turn's text may be, most likely first: reasoning
    split at ``</think>`` (as written, then with the newlines a template adds around it
    stripped), calls parsed out of the end (arguments as objects, then as written)."""
    for reasoning, content in _splits(text):
        for body, calls in _calls(content):
            turn: dict[str, Any] = {"role": "assistant", "content": body}
            if reasoning is not None:
                turn["reasoning_content"] = reasoning
            if calls:
                turn["tool_calls"] = calls
            yield turn


def _splits(text: str) -> list[tuple[str | None, str]]:
    if "</think>" not in text:
        return [(None, text)]
    head, tail = text.split("</think>", 1)
    head = head.removeprefix("<think>")
    return [(head, tail), (head.strip("\n"), tail.lstrip("\n")), (None, text)]


def _calls(content: str) -> list[tuple[str, list[dict[str, Any]]]]:
    found = [(content, [])]
    kimi = KIMI_SECTION.search(content)
    if kimi:
        raw = KIMI_CALL.findall(kimi.group(1))
        body = content[:kimi.start()]
        for as_object in (True, False):
            calls = [_call(call_id, args, as_object) for call_id, args in raw]
            if all(c is not None for c in calls):
                found.insert(len(found) - 1, (body, calls))
    qwen = list(QWEN_CALL.finditer(content))
    if qwen and content.endswith(qwen[-1].group(0)):
        calls = [_qwen_call(m.group(1)) for m in qwen]
        if all(c is not None for c in calls):
            found.insert(0, (content[:qwen[0].start()], calls))
    return found


def _call(call_id: str, arguments: str, as_object: bool) -> dict[str, Any] | None:
    name = KIMI_ID.match(call_id)
    if not name:
        return None
    value: Any = arguments
    if as_object:
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return {"id": call_id, "type": "function",
            "function": {"name": name.group(1), "arguments": value}}


def _qwen_call(body: str) -> dict[str, Any] | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    return {"type": "function", "function": {"name": call["name"],
                                             "arguments": call.get("arguments", {})}}
