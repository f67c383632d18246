"""What a process pays to import the engines and the workers, with and without bytecode.

`make install`, `make sglang-env` and `make vllm-env` compile every installed module's
bytecode (uv's ``--compile-bytecode``). Without it, where ``PYTHONDONTWRITEBYTECODE`` is set,
Python compiles every module a process imports, every time, and writes nothing back. Each
case is one fresh interpreter importing what that kind of process imports, timed from start
to exit, in rounds of "compiled" (the .pyc files the install wrote) against "source" (an
empty ``PYTHONPYCACHEPREFIX``, where Python finds no .pyc and compiles in memory), alternated
so that both see the same machine.

    .venv/bin/python bench/bench_imports.py               # ~4 min on 2 cores
    .venv/bin/python bench/bench_imports.py --only worker --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

# name: (interpreter under the repository, what that kind of process imports)
CASES = {
    "sglang": (".venv-sglang/bin/python", "import sglang.srt.entrypoints.http_server"),
    "vllm": (".venv-vllm/bin/python", "import vllm.entrypoints.openai.api_server"),
    "transformers": (".venv/bin/python", "import transformers.models.llama.modeling_llama; "
                     "from transformers import AutoModelForCausalLM, AutoTokenizer"),
    "worker": (".venv/bin/python", "import celery, kombu, redis, datagen.celery_app"),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="compiled/source pairs per case")
    p.add_argument("--only", default="", help="comma-separated cases (default: all present)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "imports.json"))
    return p.parse_args()


def timed_import(python: Path, statement: str, cache_prefix: str | None) -> float:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPYCACHEPREFIX", None)
    if cache_prefix is not None:
        env["PYTHONPYCACHEPREFIX"] = cache_prefix
    started = time.monotonic()
    subprocess.run([str(python), "-c", statement], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    return time.monotonic() - started


def measure(name: str, rounds: int) -> dict[str, Any]:
    python, statement = CASES[name]
    compiled, source = [], []
    for _ in range(rounds):
        compiled.append(timed_import(REPO / python, statement, None))
        with tempfile.TemporaryDirectory(prefix="no-pyc-") as empty:
            source.append(timed_import(REPO / python, statement, empty))
    return {"case": name, "python": python, "imports": statement,
            "compiled_s": [round(s, 2) for s in compiled],
            "source_s": [round(s, 2) for s in source],
            "compiled_median_s": round(statistics.median(compiled), 2),
            "source_median_s": round(statistics.median(source), 2),
            "source_over_compiled": round(statistics.median(source)
                                          / statistics.median(compiled), 2)}


def main() -> int:
    args = parse_args()
    wanted = [c for c in args.only.split(",") if c] or list(CASES)
    unknown = sorted(set(wanted) - set(CASES))
    if unknown:
        print(f"--only: no case {', '.join(unknown)} (cases: {', '.join(CASES)})",
              file=sys.stderr)
        return 2
    rows, missing = [], []
    for name in wanted:
        if (REPO / CASES[name][0]).is_file():
            rows.append(measure(name, args.rounds))
        else:
            missing.append(name)
    print(f"| case | compiled (s) | source (s) | source / compiled |  ({args.rounds} rounds, "
          f"medians; {os.cpu_count()} CPUs)")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['compiled_median_s']:.2f} | {r['source_median_s']:.2f} | "
              f"{r['source_over_compiled']:.2f} |")
    for name in missing:
        print(f"{name}: skipped, no {CASES[name][0]} (make sglang-env / make vllm-env)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rounds": args.rounds, "cpus": os.cpu_count(),
                                          "cases": rows, "skipped": missing}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
