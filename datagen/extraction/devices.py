"""A replica's devices from the `gpus` setting ("0-7", "0,2,4", "cpu:2"): no other import, so the
runner, the replica launcher and the backends all read them."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Devices:
    kind: str                 # "cuda" or "cpu"
    ids: tuple[int, ...]      # cuda: device indices among the visible ones; cpu: ranks

    @property
    def ranks(self) -> int:
        return len(self.ids)


def parse_gpus(spec: str) -> Devices:
    """"0-7", "0,2,4", "3", "cpu:2" (2 ranks on the CPU); "" is one device, as before."""
    spec = spec.strip()
    cpu = re.fullmatch(r"cpu(?::(\d+))?", spec)
    if cpu:
        n = int(cpu.group(1) or 1)
        if n < 1:
            raise ValueError(f"gpus={spec!r}: cpu:N needs N >= 1")
        return Devices("cpu", tuple(range(n)))
    ids: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"gpus={spec!r}: expected device ids like 0-7, 0,1,2,3 or cpu:2")
        ids += range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1)
    if not ids or len(set(ids)) != len(ids):
        raise ValueError(f"gpus={spec!r}: expected distinct device ids like 0-7 or cpu:2")
    return Devices("cuda", tuple(ids))
