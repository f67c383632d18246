"""RecordWriter: a record is fsynced when append returns; one fsync covers the lines
written before it (group commit)."""

from __future__ import annotations

import errno
import json
import math
import os
import threading
import time
from pathlib import Path

import pytest

from datagen.errors import StorageError
from datagen.generation import index, records
from datagen.generation.records import RecordWriter

THREADS = 8


def record(i: int) -> dict:
    return {"id": f"s{i:03d}", "dataset": "d", "output_ids": [i]}


def test_one_fsync_covers_the_records_written_while_another_ran(tmp_path: Path,
                                                                monkeypatch) -> None:
    writer = RecordWriter(tmp_path, "w")
    path = records.records_dir(tmp_path, "d") / "w.jsonl"
    covered: list[int] = []  # the file's size at each fsync: what it made durable
    lock = threading.Lock()

    def fsync(fd: int) -> None:
        if not covered:
            # The first fsync runs until every thread has written its line: each of
            # them must be free to write meanwhile (no write waits for an fsync). The
            # deadline only ends the wait where they are not (the test then fails).
            deadline = time.monotonic() + 60
            while path.read_bytes().count(b"\n") < THREADS and time.monotonic() < deadline:
                time.sleep(0.001)
        with lock:
            covered.append(os.fstat(fd).st_size)

    monkeypatch.setattr(records.os, "fsync", fsync)
    durable_when_returned: list[bool] = []

    def append(i: int) -> None:
        writer.append(record(i))
        # when append returns, an fsync covered this record's line
        durable = f'"s{i:03d}"'.encode() in path.read_bytes()[:max(covered)]
        with lock:
            durable_when_returned.append(durable)

    threads = [threading.Thread(target=append, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    assert durable_when_returned == [True] * THREADS
    # the first fsync made its own line durable, the next every line written meanwhile
    assert len(covered) <= 2 < THREADS
    assert path.read_bytes().count(b"\n") == THREADS


def test_a_failed_fsync_fails_the_append_and_the_next_one_syncs_again(tmp_path: Path,
                                                                      monkeypatch) -> None:
    writer = RecordWriter(tmp_path, "w")
    calls: list[int] = []

    def fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(records.os, "fsync", fsync)
    with pytest.raises(StorageError, match="s000.*No space left"):
        writer.append(record(0))
    writer.append(record(1))  # its fsync covers both lines
    assert len(calls) == 2
    writer.close()


def test_a_record_a_failed_fsync_covered_fails_though_a_later_fsync_succeeds(
        tmp_path: Path, monkeypatch) -> None:
    # Given a line flushed by one thread while another's fsync, which covers it, fails
    writer = RecordWriter(tmp_path, "w")
    writer.append(record(0))
    out = writer._files["d"]
    out.written += 1  # record 1's line: flushed, its thread not at its fsync yet
    calls: list[int] = []

    def fsync(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(records.os, "fsync", fsync)
    with pytest.raises(OSError):
        out.sync(out.written)  # the other thread's fsync, covering line 2, fails
    # When record 1's thread reaches its fsync, which would now succeed
    # Then its append fails too: the kernel may have dropped that line's pages
    with pytest.raises(OSError, match="covered this record failed"):
        out.sync(2)
    assert len(calls) == 1
    writer.append(record(2))  # a line written after the failure syncs as usual
    assert len(calls) == 2
    writer.close()


def test_close_fsyncs_what_was_written(tmp_path: Path, monkeypatch) -> None:
    writer = RecordWriter(tmp_path, "w")
    writer.append(record(0))
    calls: list[int] = []
    monkeypatch.setattr(records.os, "fsync", calls.append)
    out = writer._files["d"]
    out.written += 1  # a line flushed by a thread that has not reached its fsync yet
    writer.close()
    assert len(calls) == 1 and out.synced == out.written
    out.sync(out.written)  # that thread then finds its line synced: no fsync of a closed file
    assert len(calls) == 1


def test_a_record_line_is_json_s_bytes_nan_and_non_ascii_text_included(tmp_path: Path) -> None:
    # Given: a record whose prompt holds non-ASCII text and a NaN (a dataset line json.loads
    # took), and a latency under 1e-4 s: what orjson alone writes otherwise (null, 0.00001)
    rec = {"id": "s1", "dataset": "d", "messages": [
        {"role": "user", "content": "héllo 中文 \U0001F600\n", "score": math.nan}],
        "output_ids": [5, 6], "latency_s": 5e-05, "time": 1765086000.25}
    writer = RecordWriter(tmp_path, "w")

    # When: the worker appends it
    writer.append(rec)
    writer.close()

    # Then: the line is the bytes json.dumps always wrote, so the NaN reads back as NaN and
    # merge copies the line as it is (verbatim: the same bytes as its own encoding)
    line = (records.records_dir(tmp_path, "d") / "w.jsonl").read_bytes()
    assert line == (json.dumps(rec, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
    back = json.loads(line)
    assert math.isnan(back["messages"][0]["score"]) and back["latency_s"] == 5e-05
    assert back["messages"][0]["content"] == "héllo 中文 \U0001F600\n"
    assert index.encode(back).encode("utf-8") == line
