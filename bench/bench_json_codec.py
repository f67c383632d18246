"""A generation task's JSON from one thread: the record line, the `/generate` body and its
answer, through the standard library's json and through datagen/json_codec.py (orjson).

    .venv/bin/python bench/bench_json_codec.py --out bench/results/json_codec.json

A sample shaped like bench_generate.py's (200 prompt and 200 output ids, a 570-character
prompt); ms of CPU per call, the best of 7 repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
import timeit
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script as well as with -m
    sys.path.insert(0, str(REPO))

import orjson  # noqa: E402

from datagen import json_codec  # noqa: E402


def sample(ids: int) -> tuple[dict[str, Any], dict[str, Any], bytes]:
    """(the record, the /generate body, the answer as SGLang's orjson writes it)."""
    rng = random.Random(0)
    prompt = [rng.randrange(150_000) for _ in range(ids)]
    output = [rng.randrange(150_000) for _ in range(ids)]
    record = {"v": 1, "id": "s000123", "dataset": "B1", "rid": "d1a2b3c4" * 4, "queue": "short",
              "messages": [{"role": "user", "content": "Explain the thing. " * 30}],
              "prompt_ids": prompt, "output_ids": output,
              "finish_reason": {"type": "stop", "matched": 151645}, "prompt_tokens": ids,
              "completion_tokens": ids, "truncated": False, "trainable_tokens": ids - 1,
              "server": "http://127.0.0.1:30000", "worker": "host-1234-abcdef", "host": "host",
              "time": time.time(), "latency_s": 0.6302}
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2048, "temperature": 0.7},
            "rid": record["rid"], "stream": False}
    answer = json_codec.dumps({"text": "", "output_ids": output, "meta_info": {
        "prompt_tokens": ids, "completion_tokens": ids, "e2e_latency": 0.63,
        "finish_reason": record["finish_reason"]}})
    return record, body, answer


def best_ms(call: Any, number: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=7)) / number * 1e3


def measure(ids: int, number: int) -> dict[str, dict[str, float]]:
    record, body, answer = sample(ids)
    line = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
    assert json_codec.dumps(record) == line  # the same bytes, or the figures compare nothing
    pairs = {
        "record line": (lambda: json.dumps(record, separators=(",", ":"),
                                           ensure_ascii=False).encode(),
                        lambda: json_codec.dumps(record)),
        "/generate body": (lambda: json.dumps(body).encode(), lambda: json_codec.dumps(body)),
        "answer parse": (lambda: json.loads(answer), lambda: json_codec.loads(answer)),
    }
    return {name: {"json_ms": round(best_ms(a, number), 4),
                   "json_codec_ms": round(best_ms(b, number), 4)}
            for name, (a, b) in pairs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ids", type=int, default=200, help="prompt ids and output ids each")
    p.add_argument("--number", type=int, default=2000, help="calls per repeat")
    p.add_argument("--out", default=None, help="results JSON")
    a = p.parse_args()
    load = os.getloadavg()
    results = measure(a.ids, a.number)
    print(f"{'step':<16}{'json ms':>10}{'json_codec ms':>15}")
    for name, r in results.items():
        print(f"{name:<16}{r['json_ms']:>10.4f}{r['json_codec_ms']:>15.4f}")
    if a.out:
        out = {"command": " ".join([".venv/bin/python", "bench/bench_json_codec.py",
                                    *sys.argv[1:]]),
               "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "orjson": orjson.__version__,
               "python": platform.python_version(), "load_average_at_start": load,
               "ids": a.ids, "results": results}
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
