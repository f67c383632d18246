"""Print what bench/phase_cpu/sitecustomize.py wrote: per worker, ms of CPU per task of
each step (and per call), the steps in order of their share."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(folder: str) -> int:
    for path in sorted(Path(folder).glob("phases-*.json")):
        totals = json.loads(path.read_text())
        tasks = totals.get("runner.run_job", [0])[0]
        if not tasks:
            continue
        print(f"{path.name}: {tasks} tasks")
        for name, (calls, seconds) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
            print(f"  {name:28s} {calls:7d} calls  {1000 * seconds / tasks:7.3f} ms a task  "
                  f"{1000 * seconds / max(calls, 1):7.3f} ms a call")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
