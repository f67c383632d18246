"""The suite's longest modules first: how long each module took in a measured run.

`make test` runs `--dist loadscope --no-loadscope-reorder`: xdist hands whole modules to its
processes in collection order, and a module that takes minutes (a real-engine demo) handed out
last keeps one process busy while the other has nothing left. So collection puts modules in
order of their measured seconds, longest first; a module not measured yet counts
``UNMEASURED_S``. Only the order depends on these figures, never a result.

Re-measure after a change that moves them (the file is a pytest report, read back):

    .venv/bin/python -m pytest -n 2 --dist loadscope --durations=0 > /tmp/run.log
    .venv/bin/python tests/durations.py /tmp/run.log > tests/durations.json
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SECONDS_FILE = Path(__file__).with_name("durations.json")
UNMEASURED_S = 30.0
# A line of pytest's --durations report: "246.28s call     tests/x.py::test_y[a]"
REPORT_LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(setup|call|teardown)\s+(\S+?)::")


def module_seconds(report: str) -> dict[str, float]:
    """Each module's setup, call and teardown seconds summed, from a --durations report."""
    seconds: dict[str, float] = {}
    for line in report.splitlines():
        if match := REPORT_LINE.match(line):
            module = match.group(3)
            seconds[module] = seconds.get(module, 0.0) + float(match.group(1))
    return {module: round(s, 1) for module, s in sorted(seconds.items(), key=lambda m: -m[1])}


def load(path: Path = SECONDS_FILE) -> dict[str, float]:
    """The recorded seconds per module; none when the file is missing."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def longest_first(items: Sequence[Any], seconds: dict[str, float]) -> list[Any]:
    """``items`` (pytest items, by ``nodeid``) with their modules in order of ``seconds``,
    longest first; each module's items keep their order and stay together."""
    return sorted(items, key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0],
                                                        UNMEASURED_S))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/durations.py PYTEST_LOG (run with --durations=0)")
    json.dump(module_seconds(Path(sys.argv[1]).read_text()), sys.stdout, indent=1)
    sys.stdout.write("\n")
