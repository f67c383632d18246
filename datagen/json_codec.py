"""JSON on a generation task's hot path (the request body, the server's answer, the record
line) through orjson, with the standard library's results.

orjson encodes and parses a sample several times faster than ``json`` (the record line of a
2,000-token sample ~0.07 ms through ``json``), but differs from it in three ways, and each
falls back to ``json`` here so nothing a reader sees changes:

- it writes NaN and ±inf as ``null`` (``json`` writes ``NaN``/``Infinity``, which every
  reader of records, ``json.loads``, reads back): a float changed silently;
- it writes a float under 1e-4 in magnitude in another form (``0.00001`` for ``1e-05``):
  the same value, other bytes, and merge copies a record line as is only when its bytes are
  ``json``'s (``index.encode``);
- it refuses what ``json`` takes (an int past 64 bits, a non-str key, a lone surrogate, NaN
  in a body to parse: Python's ``json.dumps``, the simulator's, writes it).

Parsing keeps one difference (``loads``): an int past 64 bits.

Everything else (keys, their order, strings, ints, larger floats) comes out byte for byte as
``json.dumps(obj, separators=(",", ":"), ensure_ascii=False)`` (checked by
``tests/datagen/test_json_codec.py`` over random strings and floats).
"""

from __future__ import annotations

import json
import math
from typing import Any

try:
    import orjson
except ImportError:  # an engine's own Python (vLLM's venv loads the capture connector, which
    orjson = None    # imports the records module): json alone, the same bytes and values

# bytes orjson writes for every float it writes otherwise than json: null (NaN, ±inf), and a
# float under 1e-4 either as 0.0000… or with a negative exponent (…e-7). Without any of them
# in its output the record held no such float (a match in a string only costs a walk).
_SUSPECT = (b"null", b"e-", b"0.0000")
_PLAIN = frozenset({int, str, bool, type(None)})  # no float inside: a list of them is skipped


def dumps(obj: Any) -> bytes:
    """``obj`` as compact UTF-8 JSON: exactly the bytes of
    ``json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()``; raises as that
    does (TypeError for a type JSON has not, UnicodeEncodeError for a lone surrogate)."""
    if orjson is None:
        return _std_dumps(obj)
    try:
        data = orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError: a type, key or number it does not take
        return _std_dumps(obj)
    if any(s in data for s in _SUSPECT) and _has_json_only_float(obj):
        return _std_dumps(obj)
    return data


def loads(content: bytes | str) -> Any:
    """``json.loads(content)``, through orjson where it can parse it: NaN, Infinity and a
    lone surrogate escape, which it refuses, go to ``json``, as do its errors. One difference
    is left: an int past 64 bits comes back as a float (no answer field holds one: token
    ids and counts)."""
    if orjson is None:
        return json.loads(content)
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        return json.loads(content)


def _std_dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _has_json_only_float(value: Any) -> bool:
    """Whether ``value`` holds a float that orjson writes otherwise than json."""
    if isinstance(value, float):
        return not math.isfinite(value) or (value != 0.0 and abs(value) < 1e-4)
    if isinstance(value, dict):
        return any(_has_json_only_float(v) for v in value.values())
    if isinstance(value, list | tuple):
        if _PLAIN.issuperset(map(type, value)):  # token ids: one pass in C
            return False
        return any(_has_json_only_float(v) for v in value)
    return False
