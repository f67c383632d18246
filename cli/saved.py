"""A finished run's ledger read back from its saved Redis dump, once its Redis is gone.

`make demo` saves its Redis to ``<workdir>/redis/dump.rdb`` before stopping it and names the
file as ``saved_ledger`` in the settings it leaves (``<workdir>/datagen.toml``). The
read-only commands (status, dead, plot, estimate) then answer from a throwaway Redis
started on a copy of it, so the saved file is never changed.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from datagen.redis_server import RedisServer


@contextmanager
def saved_ledger(dump: Path) -> Iterator[str]:
    """The URL of a throwaway Redis holding what ``dump`` (a dump.rdb) saved."""
    if not dump.is_file():
        raise FileNotFoundError(f"saved_ledger {dump}: no such file (a Redis dump.rdb)")
    with tempfile.TemporaryDirectory(prefix="datagen-saved-ledger-") as tmp:
        shutil.copyfile(dump, Path(tmp) / "dump.rdb")
        with RedisServer(workdir=tmp) as server:
            yield server.url
