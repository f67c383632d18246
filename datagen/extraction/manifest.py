"""The manifest: one append-only JSONL per shard of the samples whose file is complete.

``output_dir/manifest/<shard-name>.jsonl`` holds ``{idx, id, dataset, path, tokens}`` per line;
a sample is done when its line exists AND its file exists (datagen/extraction/writer.py).
"""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

MANIFEST_DIR = "manifest"
METADATA = "extraction.json"  # what every file of the folder was made with
# a folder's files must agree on these; the rest (model path, backend, ranks) may differ
SAME_FOR_ALL = ("aux_layer_ids", "num_layers", "hidden_size", "dtype")


def check_metadata(output_dir: Path, meta: dict) -> None:
    """Write ``extraction.json`` on the first run; later runs must match it, so that no
    folder mixes states of different layers, models or dtypes."""
    from datagen.errors import BadInput
    from datagen.generation.records import atomic_file

    path = output_dir / METADATA
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        diff = [k for k in SAME_FOR_ALL if old.get(k) != meta.get(k)]
        if diff:
            raise BadInput(f"{path}: {', '.join(f'{k}={old.get(k)!r}' for k in diff)} but this "
                           f"worker has {', '.join(f'{k}={meta.get(k)!r}' for k in diff)}; "
                           "use another extraction_dir or remove the folder")
        return
    with atomic_file(path) as fh:
        fh.write(json.dumps(meta, indent=2) + "\n")


def shard_name(shard_path: str | Path) -> str:
    p = Path(shard_path)
    # parent folder too: every dataset folder may have its own shard-0000.jsonl
    return re.sub(r"[^A-Za-z0-9._-]", "_", f"{p.parent.name}__{p.stem}")


def load_done(output_dir: Path) -> dict[tuple[str, str], str]:
    """(dataset, id) -> relative path from every manifest; torn last lines are skipped."""
    done: dict[tuple[str, str], str] = {}
    folder = output_dir / MANIFEST_DIR
    if not folder.is_dir():
        return done
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                e = json.loads(line)
                done[(str(e["dataset"]), str(e["id"]))] = str(e["path"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    return done


class Manifest:
    """Append-only JSONL of completed samples; one ``write`` per line on an O_APPEND fd so
    lines from several threads (or a duplicate delivery of the same shard) never interleave."""

    def __init__(self, output_dir: Path, name: str):
        folder = output_dir / MANIFEST_DIR
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"{name}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()
        self._end_torn_line()

    def _end_torn_line(self) -> None:
        # a kill mid-append leaves a line without "\n"; close it so the next entry stays parseable
        size = os.fstat(self._fd).st_size
        if size:
            with open(self.path, "rb") as fh:
                fh.seek(size - 1)
                if fh.read(1) != b"\n":
                    os.write(self._fd, b"\n")

    def append(self, entry: dict) -> None:
        data = (json.dumps(entry, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._fd, data)
            os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)
