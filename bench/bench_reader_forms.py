"""Read one dataset in each file form: rows a second and the reading process's peak memory.

    .venv/bin/python bench/bench_reader_forms.py                 # 100,000 rows of ~2.4 KB
    .venv/bin/python bench/bench_reader_forms.py --rows 20000    # quicker

Each form (.jsonl, .jsonl.gz, .jsonl.zst, .parquet in row groups of 10,000 rows) holds the
same rows; each is read by ``producers.reader.read_dataset`` in a fresh process, which
reports its rows a second and how far its resident memory rose above what it held once
the reader and pyarrow were imported (Linux: the peak ``VmHWM`` reset through
``/proc/self/clear_refs`` after the imports). A reader that streams rises by its index of
digests (~130 bytes a row, to catch duplicates) and one batch, whatever the file's size; one
that loaded the file would rise by the file's decoded size.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

READ = """
import sys, time
import pyarrow  # loaded in every run, so the start is the same
from pathlib import Path
from producers.reader import Prompt, read_dataset

def status(key):
    line = next(x for x in open("/proc/self/status") if x.startswith(key))
    return int(line.split()[1])

path = sys.argv[1]
start = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) counts from here
t0 = time.monotonic()
count = 0 if path == "-" else sum(isinstance(i, Prompt) for i in read_dataset("B1", Path(path)))
took = time.monotonic() - t0
print(count, took, start, status("VmHWM:"))
"""

def rows(n: int) -> list[dict]:
    text = " ".join(f"word{i}" for i in range(300))  # ~2.3 KB a row
    return [{"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": f"Question {i}: {text}"},
                          {"role": "assistant", "content": f"Answer {i}."}]} for i in range(n)]


def write(folder: Path, data: list[dict], group_rows: int) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    lines = b"".join(json.dumps(r).encode() + b"\n" for r in data)
    paths = {form: folder / f"B1{form}" for form in (".jsonl", ".jsonl.gz", ".jsonl.zst",
                                                     ".parquet")}
    paths[".jsonl"].write_bytes(lines)
    paths[".jsonl.gz"].write_bytes(gzip.compress(lines, compresslevel=6))
    paths[".jsonl.zst"].write_bytes(zstandard.ZstdCompressor(level=3).compress(lines))
    pq.write_table(pa.Table.from_pylist(data), paths[".parquet"], row_group_size=group_rows)
    return paths


def measure(path: str) -> tuple[int, float, int, int]:
    out = subprocess.run([sys.executable, "-c", READ, path], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.split()
    return int(out[0]), float(out[1]), int(out[2]), int(out[3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--group-rows", type=int, default=10_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = write(Path(tmp), rows(args.rows), args.group_rows)
        decoded = paths[".jsonl"].stat().st_size
        print(f"{args.rows:,} rows, {decoded / 1e6:.0f} MB as JSON lines; parquet row groups "
              f"of {args.group_rows:,}; Python {platform.python_version()} on "
              f"{platform.machine()}, {os.cpu_count()} CPUs")
        print("form         file MB     rows/s   RSS after imports MB   peak rise MB")
        for form, path in paths.items():
            count, took, start_kb, peak_kb = measure(str(path))
            assert count == args.rows, (form, count)
            print(f"{form:<12} {path.stat().st_size / 1e6:7.1f} {count / took:10,.0f} "
                  f"{start_kb / 1024:22.0f} {(peak_kb - start_kb) / 1024:14.0f}")


if __name__ == "__main__":
    main()
