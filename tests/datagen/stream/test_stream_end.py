"""The end of a stream (cli/extraction.py): `datagen extract` closes the consumer's channel
after the plane's last epoch once every shard is done, so a consumer short of its horizon
(dead-lettered samples never come) ends; an earlier epoch, or a shard still to come, leaves
it open."""

from __future__ import annotations

import json
from pathlib import Path

from cli.extraction import EXIT_INCOMPLETE, _stream_finished
from config.settings import load_settings
from datagen.extraction import ledger as xlm
from datagen.generation.ledger import connect
from datagen.stream.plane import PlaneInfo


def plane(tmp_path: Path, epochs: int) -> PlaneInfo:
    """plane.json as `datagen stream --epochs N` writes it (no processes needed here)."""
    info = PlaneInfo(master_addr="127.0.0.1:1", metadata_url="http://127.0.0.1:2/metadata",
                     metrics_url="http://127.0.0.1:3/metrics", protocol="tcp", store_id="t",
                     holder_pid=0, holder_port=4, segment_bytes=1,
                     channel_path=str(tmp_path / "stream" / "consumer" / "refs.jsonl"),
                     state_dir=str(tmp_path / "stream" / "consumer" / "state"), epochs=epochs)
    info.write(tmp_path / "stream")
    return info


def settings(tmp_path: Path, redis_url: str, epoch: int):
    return load_settings(None, env={
        "DATAGEN_REDIS_URL": redis_url, "DATAGEN_OUTPUT_DIR": str(tmp_path / "out"),
        "DATAGEN_STATES_TO": "stream", "DATAGEN_STREAM_DIR": str(tmp_path / "stream"),
        "DATAGEN_STREAM_EPOCH": str(epoch)})


def finish(tmp_path: Path, redis_url: str, epoch: int, code: int, dead: bool = False) -> int:
    """Shards a and b done in ``epoch`` (b dead-lettered instead when ``dead``)."""
    s = settings(tmp_path, redis_url, epoch)
    shards = [xlm.ShardState(p, 3, 30, xlm.done_version("abc", s)) for p in ("a", "b")]
    r = connect(redis_url)
    r.delete(xlm.DONE, xlm.DEAD)
    r.hset(xlm.DONE, "a", json.dumps({"sha256": shards[0].sha256}))
    r.hset(xlm.DEAD if dead else xlm.DONE, "b", json.dumps({"sha256": shards[1].sha256}))
    return _stream_finished(s, shards, code)


def test_the_last_epoch_with_every_shard_done_closes_the_channel(tmp_path, redis_url,
                                                                 capsys) -> None:
    info = plane(tmp_path, epochs=2)
    closed = Path(info.channel_path + ".closed")
    # epoch 1 of 2, a sample dead-lettered (exit 3): open
    assert finish(tmp_path, redis_url, 1, EXIT_INCOMPLETE) == EXIT_INCOMPLETE
    assert not closed.exists()
    # epoch 2 with a dead-lettered shard: it may still come, open
    assert finish(tmp_path, redis_url, 2, EXIT_INCOMPLETE, dead=True) == EXIT_INCOMPLETE
    assert not closed.exists()
    assert "stream epoch 2 incomplete: 1 shards dead-lettered" in capsys.readouterr().out
    # epoch 2, every shard done (dead-lettered samples will never come): closed
    assert finish(tmp_path, redis_url, 2, EXIT_INCOMPLETE) == EXIT_INCOMPLETE
    assert closed.exists()
    assert "stream closed after epoch 2 of 2" in capsys.readouterr().out
