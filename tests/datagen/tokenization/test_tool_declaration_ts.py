"""Kimi-K2.5's TypeScript-style tool declaration (the demo tokenizer's ``tools_ts_str``)."""

from __future__ import annotations

from datagen.tokenization.tiktoken_tokenization import deep_sort
from datagen.tokenization.tool_declaration_ts import encode_tools_to_typescript_style

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "city": {"type": "string", "description": "The city", "maxLength": 64},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 1}}}}}}


def test_tools_are_declared_as_a_typescript_namespace() -> None:
    assert encode_tools_to_typescript_style([WEATHER]) == (
        "# Tools\n\n## functions\nnamespace functions {\n"
        "// Get the weather\n"
        "type get_weather = (_: {\n"
        "  // The city\n"
        "  // maxLength: 64\n"
        "  city: string,\n"
        "  days?: Array<\n"
        "    // minimum: 1\n"
        "    number\n"
        "  >,\n"
        '  // Default: "c"\n'
        '  unit?: "c" | "f"\n'
        "}) => any;\n"
        "}\n")


def test_no_function_tools_declare_nothing() -> None:
    assert encode_tools_to_typescript_style([]) == ""
    assert encode_tools_to_typescript_style([{"type": "_plugin", "_plugin": {}}]) == ""
    bare = {"type": "function", "function": {"name": "ping"}}
    assert encode_tools_to_typescript_style([bare]).endswith(
        "namespace functions {\ntype ping = (_: {}) => any;\n}\n")


def test_tools_keys_are_sorted_at_every_depth_lists_keep_their_order() -> None:
    assert list(deep_sort({"b": 1, "a": {"d": [{"z": 1, "y": 2}], "c": 0}})) == ["a", "b"]
    assert deep_sort({"a": {"d": [{"z": 1, "y": 2}, 3], "c": 0}}) == {
        "a": {"c": 0, "d": [{"y": 2, "z": 1}, 3]}}
