"""Tools as the TypeScript-style declaration Kimi-K2.5's tokenizer hands its template.

Not imported by the package: ``datagen.builders.tiktoken_fixture`` copies this file beside
the tokenizer class, which imports it as Kimi-K2.5's ``tokenization_kimi.py`` imports its
``tool_declaration_ts.py``: the class passes ``encode_tools_to_typescript_style(tools)`` to
the template as ``tools_ts_str``, which the published template prefers to a JSON dump.

The format (written here from the published renderers' output, e.g. tinker-cookbook's
Kimi-K2.5 renderer):

    # Tools

    ## functions
    namespace functions {
    // Get the weather
    type get_weather = (_: {
      // The city
      city: string,
      unit?: "c" | "f"
    }) => any;
    }

Required fields come first, then optional ones (``?``), each group sorted by name; a field's
description and constraints are ``//`` lines above it (and ``// Default: ...``); ``integer``
is ``number``; ``$defs`` become ``interface`` declarations before the function. Only tools
of type ``function`` are declared; without any the text is "".
"""

from __future__ import annotations

import json
from typing import Any

INDENT = "  "
CONSTRAINTS = {"string": ("maxLength", "minLength", "pattern"),
               "number": ("maximum", "minimum"), "integer": ("maximum", "minimum"),
               "array": ("maxItems", "minItems")}
UNION_NAMES = {"string": "string", "number": "number", "integer": "number",
               "boolean": "boolean", "null": "null", "object": "{}", "array": "Array<any>"}


def encode_tools_to_typescript_style(tools: list[dict[str, Any]]) -> str:
    functions = [_function(tool["function"]) for tool in tools or []
                 if tool.get("type") == "function" and tool.get("function")]
    if not functions:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"


def comment(text: str, indent: str = "") -> str:
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


def _function(function: dict[str, Any]) -> str:
    schema = function.get("parameters") or {}
    defs = schema.get("$defs") or {}
    self_ref = _refers_to_root(schema)
    interfaces = []
    if self_ref:
        required = set(schema.get("required") or [])  # fields in their given order here
        fields = ",\n".join(_field(name, prop, name not in required, INDENT)
                             for name, prop in (schema.get("properties") or {}).items())
        interfaces.append("interface parameters {" + (f"\n{fields}\n" if fields else "") + "}")
    for name, definition in defs.items():
        described = comment(definition["description"]) + "\n" \
            if definition.get("description") else ""
        interfaces.append(f"{described}interface {name} {_type(definition, '')}")
    params = "parameters" if self_ref else _object(schema, "")
    parts = ["\n".join(interfaces), comment(function["description"])
             if function.get("description") else "",
             f"type {function.get('name', 'function')} = (_: {params}) => any;"]
    return "\n".join(part for part in parts if part)


def _refers_to_root(schema: Any) -> bool:
    if isinstance(schema, dict):
        return schema.get("$ref") == "#" or any(_refers_to_root(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_refers_to_root(v) for v in schema)
    return False


def _doc(schema: Any, indent: str) -> str:
    if not isinstance(schema, dict) or "$ref" in schema or "anyOf" in schema:
        described = schema.get("description") if isinstance(schema, dict) else None
        return comment(described, indent) + "\n" if described else ""
    lines = [comment(schema["description"], indent)] if schema.get("description") else []
    kind = schema.get("type") if "enum" not in schema else None
    limits = sorted((k, schema[k]) for k in CONSTRAINTS.get(kind, ()) if k in schema) \
        if isinstance(kind, str) else []
    if limits:
        lines.append(indent + "// " + ", ".join(f"{k}: {v}" for k, v in limits))
    return "".join(line + "\n" for line in lines)


def _fields(schema: dict[str, Any], indent: str) -> str:
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    ordered = sorted(n for n in properties if n in required) + \
        sorted(n for n in properties if n not in required)
    fields = [_field(name, properties[name], name not in required, indent) for name in ordered]
    extra = schema.get("additionalProperties")
    if extra is not None:
        shown = "never" if extra is False else "any" if extra is True else _type(extra, indent)
        fields.append(f"{indent}[k: string]: {shown}")
    return ",\n".join(fields)


def _field(name: str, schema: Any, optional: bool, indent: str) -> str:
    text = _doc(schema, indent)
    default = schema.get("default") if isinstance(schema, dict) else None
    if default is not None:
        shown = repr(default) if isinstance(default, (bool, int, float)) \
            else json.dumps(default, ensure_ascii=False)
        text += f"{indent}// Default: {shown}\n"
    return f"{text}{indent}{name}{'?' if optional else ''}: {_type(schema, indent)}"


def _object(schema: dict[str, Any], indent: str) -> str:
    fields = _fields(schema, indent + INDENT)
    return f"{{\n{fields}\n{indent}}}" if fields else "{}"


def _type(schema: Any, indent: str) -> str:
    if isinstance(schema, bool):
        return "any" if schema else "null"
    if "$ref" in schema:
        return "parameters" if schema["$ref"] == "#" else schema["$ref"].split("/")[-1]
    if "anyOf" in schema:
        return " | ".join(_type(option, indent) for option in schema["anyOf"])
    if "enum" in schema:
        return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in schema["enum"])
    kind = schema.get("type")
    if kind is None:
        if schema:
            raise ValueError(f"not a JSON schema: {schema}")
        return "any"
    if isinstance(kind, list):
        return " | ".join(UNION_NAMES[k] for k in kind)
    if kind == "object":
        return _object(schema, indent)
    if kind == "array":
        return _array(schema, indent)
    return "number" if kind == "integer" else kind


def _array(schema: dict[str, Any], indent: str) -> str:
    item = schema.get("items") or {"type": "any"}
    doc = _doc(item, indent + INDENT)
    if doc:
        return f"Array<\n{doc}{indent}{INDENT}{_type(item, indent + INDENT)}\n{indent}>"
    return f"Array<{_type(item, indent)}>"
