"""The stream's per-epoch ledger (datagen/stream/ledger.py) on a real Redis: room is reserved
under the bound before a put, acks free it once, epochs are apart, and status says so."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from datagen.extraction.ledger import done_version
from datagen.generation.ledger import connect
from datagen.stream.ledger import StreamLedger, status_lines


def test_room_is_reserved_under_the_bound_and_freed_once_by_its_ack(redis_url: str) -> None:
    ledger = StreamLedger(connect(redis_url), 1)
    # the first sample fits even above the bound (it alone could never wait its way in)
    assert ledger.reserve("B1/a@e1", 150, 100)
    assert not ledger.reserve("B1/b@e1", 10, 100)
    assert ledger.reserve("B1/a@e1", 150, 100)  # a re-run's put of the same id: its own room
    assert ledger.resident_bytes() == 150
    # acks of another epoch, of an unknown id, or twice, free nothing more
    assert ledger.acked({"B1/a@e2", "B1/x@e1"}) == 0
    assert ledger.acked({"B1/a@e1"}, now=1000.0) == 1
    assert ledger.acked({"B1/a@e1"}) == 0
    assert ledger.resident_bytes() == 0
    assert ledger.reserve("B1/b@e1", 60, 100) and not ledger.reserve("B1/c@e1", 50, 100)
    assert ledger.reserve("B1/c@e1", 40, 100) and ledger.resident_bytes() == 100
    ledger.published("B1/b@e1", 60)
    assert ledger.is_published("B1/b@e1") and not ledger.is_published("B1/c@e1")
    assert not StreamLedger(ledger.r, 2).is_published("B1/b@e2")


def test_status_shows_published_acked_resident_and_the_trainers_rate(redis_url: str) -> None:
    ledger = StreamLedger(connect(redis_url), 1)
    for i in range(4):
        assert ledger.reserve(f"B1/s{i}@e1", 1 << 20, 8 << 20)
        ledger.published(f"B1/s{i}@e1", 1 << 20)
    ledger.acked({"B1/s0@e1", "B1/s1@e1", "B1/s2@e1"})
    ledger.r.hset(ledger.acked_key, "B1/s0@e1", 0.0)  # acked long ago: out of the window
    assert status_lines(ledger.r, 8 << 20) == [
        "stream epoch 1: 4 published, 3 acknowledged, 1.0 MiB resident of 8.0 MiB "
        "(stream_resident_bytes); trainer 0.03 samples/s over the last 60 s"]


def test_a_shard_done_in_one_epoch_is_to_do_in_the_next() -> None:
    files = SimpleNamespace(states_to="files", stream_epoch=1)
    assert done_version("abc", files) == "abc"
    one, two = (done_version("abc", SimpleNamespace(states_to="stream", stream_epoch=e))
                for e in (1, 2))
    assert one == "abc@e1" and two == "abc@e2"


def test_datagen_status_prints_each_streamed_epoch(redis_url: str, tmp_path, monkeypatch,
                                                   capsys) -> None:
    from cli.main import main

    ledger = StreamLedger(connect(redis_url), 2)
    assert ledger.reserve("B1/a@e2", 3 << 20, 8 << 20)
    ledger.published("B1/a@e2", 3 << 20)
    monkeypatch.setenv("DATAGEN_REDIS_URL", redis_url)
    monkeypatch.setenv("DATAGEN_OUTPUT_DIR", str(tmp_path))
    monkeypatch.setenv("DATAGEN_STREAM_RESIDENT_BYTES", str(8 << 20))
    assert main(["status"]) == 0
    assert ("stream epoch 2: 1 published, 0 acknowledged, 3.0 MiB resident of 8.0 MiB"
            in capsys.readouterr().out)


def test_a_gpu_worker_of_another_epoch_than_extract_asked_refuses_the_shard(
        redis_url: str) -> None:
    from datagen.errors import StreamUnavailable
    from datagen.stream.ledger import ask_epoch, require_epoch

    r = connect(redis_url)
    require_epoch(r, 1)  # nothing asked yet: the worker's own setting
    ask_epoch(r, 2)
    require_epoch(r, 2)
    with pytest.raises(StreamUnavailable, match="restart the gpu workers with stream_epoch = 2"):
        require_epoch(r, 1)


def test_status_records_the_consumers_last_acks_and_says_when_it_ended(
        redis_url: str, tmp_path, monkeypatch, capsys) -> None:
    # Given: 3 samples published in epoch 1, the last put made with room to spare, so no gpu
    # worker asked the consumer again; the consumer (its own SQLite) acknowledged all 3
    from specforge.runtime.control_plane.metadata_store import SQLiteMetadataStore
    from test_stream_end import plane

    from cli.main import main

    info = plane(tmp_path, epochs=1)
    ledger = StreamLedger(connect(redis_url), 1)
    ids = [f"B1/s{i}@e1" for i in range(3)]
    for sid in ids:
        assert ledger.reserve(sid, 1 << 20, 8 << 20)
        ledger.published(sid, 1 << 20)
    ledger.acked(ids[:1])
    Path(info.state_dir).mkdir(parents=True)
    SQLiteMetadataStore(str(info.db_path)).record_train_ack(ids, global_step=3,
                                                            optimizer_durable=False)
    monkeypatch.setenv("DATAGEN_REDIS_URL", redis_url)
    monkeypatch.setenv("DATAGEN_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.setenv("DATAGEN_STREAM_DIR", str(tmp_path / "stream"))
    monkeypatch.setenv("DATAGEN_STREAM_RESIDENT_BYTES", str(8 << 20))

    # When/Then: `datagen status` shows all 3 acknowledged and nothing resident (before: 1 and
    # 2 MiB, what the ledger held), and the rate while the consumer runs
    assert main(["status"]) == 0
    assert ("stream epoch 1: 3 published, 3 acknowledged, 0.0 MiB resident of 8.0 MiB "
            "(stream_resident_bytes); trainer " in capsys.readouterr().out)
    assert ledger.acked_ids() == set(ids)
    # and once the consumer ended, that instead of a rate
    Path(info.channel_path + ".consumer_done").touch()
    assert main(["status"]) == 0
    assert "0.0 MiB resident of 8.0 MiB (stream_resident_bytes); trainer ended" in \
        capsys.readouterr().out
