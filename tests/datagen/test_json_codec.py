"""json_codec: orjson's speed, json's bytes and values (the record line, the request body,
the server's answer)."""

from __future__ import annotations

import json
import math
import random
import struct
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from datagen import json_codec


def std(obj: object) -> bytes:
    """What the records were always written as."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def random_text(rng: random.Random) -> str:
    ranges = [(0, 0x7F), (0x80, 0xD7FF), (0xE000, 0x10FFFF)]  # no lone surrogates
    return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(0, 12)))


def random_float(rng: random.Random) -> float:
    while True:
        x = struct.unpack("<d", rng.randbytes(8))[0] if rng.random() < 0.5 else \
            math.ldexp(rng.random(), rng.randint(-60, 70)) * rng.choice((1, -1))
        if math.isfinite(x):
            return x


def test_a_record_comes_out_as_json_wrote_it_non_ascii_text_and_controls_included() -> None:
    rng = random.Random(7)
    record = {"v": 1, "id": "s1", "messages": [
        {"role": "user",
         "content": "héllo 中文 \U0001F600 \u2028\u2029 \x00\x1f\x7f \"\\/\b\f\n\r\t"}],
        "prompt_ids": list(range(2000)), "output_ids": [151645, 0, 2**63 - 1],
        "finish_reason": {"type": "stop", "matched": None}, "truncated": False,
        "time": 1765086000.1234567, "latency_s": 0.25, "big": 1e16, "tiny": 5e-324}
    assert json_codec.dumps(record) == std(record)
    for _ in range(20000):
        value = [random_text(rng), {random_text(rng): random_float(rng)}, random_float(rng)]
        assert json_codec.dumps(value) == std(value), value


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e-05, -9.9e-05, 1e-07,
                                   6.4e-09])
def test_a_float_orjson_writes_otherwise_is_written_as_json_writes_it(value: float) -> None:
    # Given: a record whose prompt carries the float deep inside (a tool call's argument)
    record = {"id": "s1", "messages": [{"role": "assistant", "tool_calls": [
        {"function": {"arguments": {"x": value}}}]}], "prompt_ids": [1, 2, 3]}
    assert orjson.dumps(record) != std(record)  # orjson alone: null for NaN, 0.00001 for 1e-05

    # When: it is encoded
    line = json_codec.dumps(record)

    # Then: json's bytes, and the value reads back unchanged (NaN as NaN, not None)
    assert line == std(record)
    back = json.loads(line)["messages"][0]["tool_calls"][0]["function"]["arguments"]["x"]
    assert back == value or (math.isnan(back) and math.isnan(value))


def test_what_orjson_refuses_is_encoded_or_refused_as_json_does() -> None:
    wide = {"n": 2**70, "keys": {1: "a", 2.5: "b", None: "c"}}
    assert json_codec.dumps(wide) == std(wide)
    with pytest.raises(UnicodeEncodeError):  # as `line.encode("utf-8")` always raised
        json_codec.dumps({"content": "a\ud800"})
    with pytest.raises(TypeError):
        json_codec.dumps({"x": object()})


def test_an_answer_with_nan_or_infinity_is_parsed_as_json_parses_it() -> None:
    # Python's json.dumps (the simulator's, any engine written with it) writes NaN literals
    body = json.dumps({"meta_info": {"e2e_latency": math.nan, "x": math.inf},
                       "output_ids": [1, 2], "text": "é"}).encode()
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(body)
    data = json_codec.loads(body)
    assert math.isnan(data["meta_info"]["e2e_latency"]) and data["meta_info"]["x"] == math.inf
    assert data["output_ids"] == [1, 2] and data["text"] == "é"
    assert json_codec.loads(b'"\\ud800"') == "\ud800"
    with pytest.raises(ValueError):
        json_codec.loads(b'{"output_ids": [1,')


def test_without_orjson_the_records_module_loads_and_writes_json_s_bytes() -> None:
    # Given: a Python without orjson, as vLLM's own venv, which loads the capture connector
    # and through it the records module
    code = ("import sys; sys.modules['orjson'] = None\n"
            "import json; from datagen.generation import records; from datagen import json_codec\n"
            "obj = {'id': 'é', 'x': float('nan'), 'ids': [1, 2]}\n"
            "assert json_codec.orjson is None\n"
            "assert json_codec.dumps(obj) == json.dumps(obj, separators=(',', ':'), "
            "ensure_ascii=False).encode()\n"
            "assert json_codec.loads(b'[NaN, 1]')[1] == 1\n"
            "print('ok')")
    # When: the codec is used there; Then: json's bytes and values
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[2])
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
