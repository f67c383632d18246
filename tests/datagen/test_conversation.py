"""The conversation model: nulls as the servers take them, and the ids a request carries."""

from __future__ import annotations

import pytest

from datagen.conversation import ConversationError, messages_of, tools_of


def test_a_datasets_export_with_null_fields_everywhere_is_read() -> None:
    # Given: every struct field on every message, null where the message has none
    def row(role, content, **fields):
        return {"role": role, "content": content, "name": None, "tool_call_id": None,
                "tool_calls": None, "reasoning_content": None, **fields}
    turns = messages_of([
        row("user", "weather?"),
        row("assistant", None, tool_calls=[{"id": None, "type": "function", "function": {
            "name": "get", "arguments": None}}]),
        row("tool", "12C"),
        row("assistant", None, tool_calls=[{"id": "c2", "type": "function", "function": {
            "name": "get", "arguments": ""}}]),
        row("tool", "13C", tool_call_id="c2")], "messages")
    # Then: nulls are absent fields, null or "" arguments are {}, as both servers take them
    assert turns[0] == {"role": "user", "content": "weather?"}
    assert turns[1]["tool_calls"][0]["function"]["arguments"] == {}
    assert turns[3]["tool_calls"][0]["function"]["arguments"] == {}
    assert tools_of([{"type": "function", "function": {"name": "get", "parameters": None}}])


def test_calls_without_ids_get_kimis_ids_counted_over_the_conversation() -> None:
    call = {"type": "function", "function": {"name": "get", "arguments": {}}}
    turns = messages_of([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "c"}], "messages")
    assert [c["id"] for c in turns[1]["tool_calls"]] == ["functions.get:0", "functions.get:1"]
    assert turns[4]["tool_calls"][0]["id"] == "functions.get:2"
    # each result answers the call at its place in the run
    assert [turns[i]["tool_call_id"] for i in (2, 3, 5)] == [
        "functions.get:0", "functions.get:1", "functions.get:2"]


def test_more_results_than_calls_without_ids_is_refused() -> None:
    call = {"type": "function", "function": {"name": "get", "arguments": {}}}
    with pytest.raises(ConversationError, match="turn 4: a result without a tool_call_id"):
        messages_of([{"role": "user", "content": "q"},
                     {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}],
                    "messages")


def test_a_result_of_a_call_written_as_text_is_read_without_an_id() -> None:
    turns = messages_of([{"role": "user", "content": "q"},
                         {"role": "assistant", "content": "[get(city='Paris')]"},
                         {"role": "tool", "content": "12C"}], "messages")
    assert turns[2] == {"role": "tool", "content": "12C"}
