"""Every file form a dataset comes in: .jsonl, .jsonl.gz, .jsonl.zst and .parquet, read as
streams; bad rows named by file and row, broken files reported while the rest goes on."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from producers import files
from producers.reader import BadRecord, Prompt, discover_datasets, read_dataset

ROWS = [{"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": f"Question {i}?"},
                      {"role": "assistant", "content": f"Answer {i}."}]} for i in range(6)]


def jsonl_bytes(rows: list[Any]) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n"
                    for r in rows)


def write_form(path: Path, rows: list[Any]) -> Path:
    """rows in the form path's name says: JSON lines (raw bytes kept as they are), gzip,
    zstd, or parquet (dicts, pyarrow's own types)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".parquet"):
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(jsonl_bytes(rows)))
    elif path.name.endswith(".zst"):
        path.write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes(rows)))
    else:
        path.write_bytes(jsonl_bytes(rows))
    return path


def read(path: Path, name: str = "B1_forms") -> list[Prompt | BadRecord]:
    return list(read_dataset(name, path))


FORMS = ["d.jsonl", "d.jsonl.gz", "d.jsonl.zst", "d.parquet"]


@pytest.mark.parametrize("name", FORMS)
def test_every_form_reads_the_same_prompts_with_the_same_ids(tmp_path: Path, name: str) -> None:
    # Given: the same rows as plain JSON lines and in the form under test
    plain = read(write_form(tmp_path / "plain" / "d.jsonl", ROWS))
    # When: the form is read
    got = read(write_form(tmp_path / "form" / name, ROWS))
    # Then: the same prompts, answers and content-derived sample ids (a dataset converted
    # from one form to another resumes: the ids do not depend on the file)
    assert all(isinstance(p, Prompt) for p in got)
    assert [(p.sample_id, p.messages, p.answer) for p in got] == \
        [(p.sample_id, p.messages, p.answer) for p in plain]
    assert len(got) == len(ROWS)


def test_a_partition_names_each_form_of_single_file_dataset(tmp_path: Path) -> None:
    for name in ("B1.jsonl.gz", "B2.jsonl.zst", "B3.parquet", "B4.jsonl"):
        write_form(tmp_path / name, ROWS[:1])
    hub = write_form(tmp_path / "B5" / "data" / "train-00000-of-00002.parquet", ROWS[:2])
    write_form(hub.with_name("train-00001-of-00002.parquet"), ROWS[2:3])
    (tmp_path / "B5" / ".gitattributes").write_text("*.parquet filter=lfs")
    (tmp_path / "notes.txt").write_text("not data")
    found = dict(discover_datasets(tmp_path))
    assert sorted(found) == ["B1", "B2", "B3", "B4", "B5"]
    assert found["B1"] == tmp_path / "B1.jsonl.gz"
    assert [p.messages[1]["content"] for p in read(found["B5"])] == \
        ["Question 0?", "Question 1?", "Question 2?"]


def test_the_same_name_in_two_forms_is_refused(tmp_path: Path) -> None:
    write_form(tmp_path / "B1.jsonl", ROWS[:1])
    write_form(tmp_path / "B1.parquet", ROWS[:1])
    with pytest.raises(ValueError, match="dataset 'B1' is both"):
        discover_datasets(tmp_path)


@pytest.mark.parametrize("name", ["d.jsonl.gz", "d.jsonl.zst"])
def test_a_bad_line_of_a_compressed_file_is_named_by_file_and_line(tmp_path: Path,
                                                                  name: str) -> None:
    path = write_form(tmp_path / name, [ROWS[0], b"{not json", ROWS[1]])
    first, bad, last = read(path)
    assert isinstance(bad, BadRecord) and str(bad).startswith(f"{path}:2: invalid JSON")
    assert isinstance(last, Prompt) and last.source == f"{path}:3"


def test_a_bad_parquet_row_is_named_by_its_index_in_the_file(tmp_path: Path) -> None:
    # Given: a plain-prompt parquet file whose row 1 (from 0) has no prompt
    path = write_form(tmp_path / "d.parquet", [{"prompt": "a"}, {"prompt": None},
                                               {"prompt": "c"}])
    # When/Then: that row is reported with its index and why; the rows around it are read
    first, bad, last = read(path)
    assert isinstance(bad, BadRecord)
    assert str(bad) == f"{path}:1: 'prompt' must be a string, got null"
    assert (first.source, last.source) == (f"{path}:0", f"{path}:2")


@pytest.mark.parametrize("name", ["a.jsonl.gz", "a.jsonl.zst"])
def test_a_truncated_compressed_file_is_reported_and_the_dataset_goes_on(tmp_path: Path,
                                                                         name: str) -> None:
    # Given: a dataset whose first file was cut off mid-stream, then a whole second file
    # (digests: text zstd cannot shrink much, so the cut falls after whole 128 KB blocks)
    rows = [{"prompt": hashlib.sha256(str(i).encode()).hexdigest() * 4} for i in range(4000)]
    whole = write_form(tmp_path / "B1" / name, rows).read_bytes()
    (tmp_path / "B1" / name).write_bytes(whole[: len(whole) // 2])
    write_form(tmp_path / "B1" / "b.jsonl", [{"prompt": "after"}])
    # When: the dataset is read
    items = read(tmp_path / "B1")
    # Then: the rows before the cut, one report naming the file, its line and the cut, and
    # the next file read whole
    bad = [item for item in items if isinstance(item, BadRecord)]
    prompts = [item for item in items if isinstance(item, Prompt)]
    assert len(bad) == 1 and bad[0].path == str(tmp_path / "B1" / name)
    assert "truncated" in bad[0].reason and "the rest of it is skipped" in bad[0].reason
    assert bad[0].line == len(prompts)  # the line after the last one read
    assert 0 < len(prompts) - 1 < len(rows)
    assert prompts[-1].messages[0]["content"] == "after"


def test_a_damaged_or_foreign_parquet_file_is_reported_and_the_dataset_goes_on(
        tmp_path: Path) -> None:
    (tmp_path / "B1").mkdir()
    (tmp_path / "B1" / "a.parquet").write_bytes(b"this is not a parquet file" * 10)
    write_form(tmp_path / "B1" / "b.parquet", [{"text": "a dataset of other columns"}])
    write_form(tmp_path / "B1" / "c.parquet", [{"prompt": "after"}])
    broken, foreign, good = read(tmp_path / "B1")
    assert isinstance(broken, BadRecord) and broken.path.endswith("a.parquet")
    assert "not a readable parquet file" in broken.reason
    assert isinstance(foreign, BadRecord) and "(columns: text)" in foreign.reason
    assert isinstance(good, Prompt) and good.messages[0]["content"] == "after"


def test_a_multi_frame_zstd_file_is_read_to_its_end(tmp_path: Path) -> None:
    # zstd tools (pzstd, zstd --long chunks) write one frame after another
    frames = [zstandard.ZstdCompressor().compress(jsonl_bytes(ROWS[i:i + 2]))
              for i in range(0, 6, 2)]
    path = tmp_path / "d.jsonl.zst"
    path.write_bytes(b"".join(frames))
    assert [p.sample_id for p in read(path)] == \
        [p.sample_id for p in read(write_form(tmp_path / "x" / "d.jsonl", ROWS))]


def test_a_parquet_row_of_a_type_json_has_not_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "id": [b"\x00raw", b"\x01raw"]}), path)
    assert all(isinstance(item, BadRecord) and "must be a string or an integer" in item.reason
               for item in read(path))


def test_a_large_parquet_file_is_read_one_row_group_at_a_time(tmp_path: Path) -> None:
    # Given: a parquet file of 40 row groups of 350 rows
    path = tmp_path / "big.parquet"
    text = " ".join(f"word{i}" for i in range(400))
    with pq.ParquetWriter(path, pa.schema([("prompt", pa.string())])) as writer:
        for g in range(40):
            writer.write_table(pa.table({"prompt": [f"group {g} row {r}: {text}"
                                                    for r in range(350)]}))
    # When: the first row has come, and only then row group 30's bytes are overwritten
    rows = read_dataset("B1_big", path)
    first = next(rows)
    chunk = pq.ParquetFile(path).metadata.row_group(30).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    with path.open("r+b") as fh:
        fh.seek(start)
        fh.write(b"\xff" * chunk.total_compressed_size)
    rest = list(rows)
    # Then: the 30 groups before it come whole, and the damage is reported at group 30's
    # first row: nothing past the group being read was in memory when the first row came
    # (iter_batches over the whole file pre-buffers every group before the first batch)
    assert isinstance(first, Prompt) and first.source == f"{path}:0"
    assert all(isinstance(item, Prompt) for item in rest[:-1]) and len(rest) == 30 * 350
    assert isinstance(rest[-1], BadRecord) and rest[-1].line == 30 * 350
    assert "not a readable parquet file past row 10500" in rest[-1].reason


def test_row_counts_for_progress_come_from_lines_and_parquet_metadata(tmp_path: Path) -> None:
    plain = write_form(tmp_path / "a.jsonl", ROWS)
    table = write_form(tmp_path / "b.parquet", ROWS[:4])
    assert files.count_rows([plain, table]) == 10
    # a compressed file would have to be decompressed to count: no total, no ETA
    assert files.count_rows([plain, write_form(tmp_path / "c.jsonl.zst", ROWS)]) is None
