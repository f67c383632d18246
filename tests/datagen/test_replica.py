"""The replica's start-up checks and the reaper of taken shards (a real Redis, no model)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import wait_until

from config.settings import load_settings
from datagen import keys
from datagen.extraction import ledger as xlm
from datagen.extraction import runner
from datagen.extraction.replica import Devices, check_start, is_replica, parse_gpus, rank_env
from datagen.generation.ledger import connect


@pytest.mark.parametrize(("spec", "kind", "ids"), [
    ("0-7", "cuda", tuple(range(8))), ("0,2,4", "cuda", (0, 2, 4)), ("3", "cuda", (3,)),
    ("0-1,4", "cuda", (0, 1, 4)), ("cpu:2", "cpu", (0, 1)), ("cpu", "cpu", (0,))])
def test_gpus_spec(spec: str, kind: str, ids: tuple[int, ...]) -> None:
    assert parse_gpus(spec) == Devices(kind, ids)


@pytest.mark.parametrize("spec", ["7-0", "a", "0,0", "cpu:0", "0-", "gpu:2"])
def test_bad_gpus_spec_names_the_setting(spec: str) -> None:
    with pytest.raises(ValueError, match=r"gpus="):
        parse_gpus(spec)


def test_start_refused_with_fewer_devices_or_a_one_device_backend() -> None:
    s = load_settings(None, env={"DATAGEN_GPUS": "0-7", "DATAGEN_EXTRACT_BACKEND": "hf-tp"})
    with pytest.raises(ValueError, match=r"asks for device 7 but 2 CUDA devices are visible"):
        check_start(s, parse_gpus("0-7"), visible=2)
    check_start(s, parse_gpus("0-7"), visible=8)
    hf = s.replace(extract_backend="hf")
    with pytest.raises(ValueError, match=r"runs on one device: use vllm, hf-tp or sglang"):
        check_start(hf, parse_gpus("0-7"), visible=8)
    with pytest.raises(ValueError, match=r"sglang' needs CUDA"):
        check_start(s.replace(extract_backend="sglang"), parse_gpus("cpu:2"))
    assert not is_replica(hf, parse_gpus("3")) and is_replica(s, parse_gpus("3"))
    # vllm: one worker process whose engine spans the 8 devices itself (its own TP)
    engine = s.replace(extract_backend="vllm")
    check_start(engine, parse_gpus("0-7"), visible=8)
    assert not is_replica(engine, parse_gpus("0-7"))
    assert runner.extraction_config(engine).engine.tensor_parallel == 8


def test_ranks_see_the_replica_devices_among_the_visible_ones() -> None:
    env = rank_env(parse_gpus("1,3"), 1, 29500, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert env["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("1", "1", "2")
    assert rank_env(parse_gpus("cpu:2"), 0, 1, {})["CUDA_VISIBLE_DEVICES"] == ""


def test_reaper_requeues_a_dead_run_ahead_of_fresh_shards_and_dead_letters_a_repeat(
        redis_url: str, tmp_path: Path) -> None:
    r = connect(redis_url)
    settings = load_settings(None, env={"DATAGEN_REDIS_URL": redis_url,
                                        "DATAGEN_OUTPUT_DIR": str(tmp_path),
                                        "DATAGEN_EXTRACT_MAX_RETRIES": "1"})
    xl = xlm.ExtractionLedger(r)
    # a run that died holding its shard (owner, no lease), one that died for the second
    # time, one that failed and waits out its retry delay, and one that runs
    for shard, entry in {"a": {"tries": 0, "owner": "gone"}, "b": {"tries": 1, "owner": "gone"},
                         "c": {"tries": 1, "owner": None, "not_before": time.time() + 60},
                         "d": {"tries": 0, "owner": "live"}}.items():
        r.hset(xlm.RUNNING, shard, json.dumps(entry))
    r.set(xlm.lease_key("d"), "live")
    sent: list[tuple[str, bool]] = []

    assert runner.reap(settings, xl, lambda shard, retry: sent.append((shard, retry))) == 1

    assert sent == [("a", True)]
    assert json.loads(r.hget(xlm.RUNNING, "a"))["tries"] == 1
    assert "b" in xl.dead() and "2 runs ended without a result, the last on gone" in (
        xl.dead()["b"]["reason"])
    assert set(r.hkeys(xlm.RUNNING)) == {"a", "c", "d"}
    assert r.exists(keys.EXTRACT_REAPER_LOCK)


def test_reclaimed_shards_are_sent_at_the_retry_priority(redis_url: str) -> None:
    from datagen.celery_app import make_app

    r = connect(redis_url)
    settings = load_settings(None, env={"DATAGEN_REDIS_URL": redis_url})
    app = make_app(settings)
    runner.send_shard(app, "fresh")
    runner.send_shard(app, "back", retry=True)
    lists = keys.queue_lists(xlm.GPU_QUEUE)
    assert r.llen(lists[0]) == 1 and r.llen(lists[-1]) == 1  # step 0 is served first
    assert xlm.ExtractionLedger(r).queued("datagen.extract") == {"fresh", "back"}


def test_a_message_taken_but_never_run_is_sent_again_after_a_lease(redis_url: str,
                                                                  tmp_path: Path) -> None:
    from kombu import Queue

    from datagen.celery_app import EXTRACT_TASK, make_app

    # Given: two shards sent as `datagen extract` sends them; a consumer (a gpu worker's,
    # no acks) takes one message and dies before its run: the message is gone from Redis
    r = connect(redis_url)
    settings = load_settings(None, env={"DATAGEN_REDIS_URL": redis_url,
                                        "DATAGEN_OUTPUT_DIR": str(tmp_path)})
    app = make_app(settings)
    xl = xlm.ExtractionLedger(r)
    runner.enqueue(app, xl, ["taken", "waiting"])
    taken: list[str] = []
    with app.connection_for_read() as conn:
        consumer = app.amqp.TaskConsumer(conn, queues=[Queue(xlm.GPU_QUEUE)], callbacks=[
            lambda body, message: taken.append(message.payload[1]["shard"])])
        consumer.qos(prefetch_count=1)
        with consumer:
            conn.drain_events(timeout=10)
    assert taken in (["taken"], ["waiting"])  # one of them, whichever came first
    gone, left = taken[0], ({"taken", "waiting"} - set(taken)).pop()
    assert xl.queued(EXTRACT_TASK) == {left} and r.hlen("unacked") == 0
    sent: list[tuple[str, bool]] = []

    def reap(lease_s: float) -> int:
        r.delete(keys.EXTRACT_REAPER_LOCK)  # one reaper per second: here, every call
        return runner.reap(settings.replace(lease_s=lease_s), xl,
                           lambda shard, retry: sent.append((shard, retry)))

    # When/Then: within a lease of the send its taker may still be about to start: left alone
    assert reap(3600) == 0
    # a lease after the send it is neither queued nor leased: sent again, ahead of fresh
    # shards; the one still waiting in the queue is not
    time.sleep(0.01)
    assert reap(0.005) == 1
    assert sent == [(gone, True)]
    entry = json.loads(r.hget(xlm.RUNNING, gone))
    assert entry["sent"] and entry["tries"] == 0 and entry["requeued_by"] == runner.worker_id()
    assert reap(3600) == 0  # just sent again: a lease to be taken
    app.close()


def test_a_failed_run_is_retried_after_its_delay_not_a_lease(redis_url: str) -> None:
    # Given: a shard sent, taken by a run (its lease) that failed: retry in 0.1 s
    r = connect(redis_url)
    settings = load_settings(None, env={"DATAGEN_REDIS_URL": redis_url, "DATAGEN_LEASE_S": "60"})
    xl = xlm.ExtractionLedger(r)
    xl.sent(["s"])
    with pytest.raises(RuntimeError), xl.lease("s", "me", 60):
        raise RuntimeError("disk error")
    xl.retry_later("s", 0.1)
    sent: list[str] = []
    # When/Then: sent again once the delay is over, though it was sent well within a lease
    wait_until(lambda: runner.reap(settings, xl, lambda shard, _r: sent.append(shard)) == 1,
               10, 0.05, what="the retry")
    assert sent == ["s"]


RANK_SCRIPT = """
import os, signal, sys, time
from datetime import timedelta
import torch.distributed as dist
from datagen.extraction.replica import announce, receive
rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
group = dist.new_group(backend="gloo", timeout=timedelta(days=30))  # as init_groups makes it
if rank == 1:
    assert receive(group) == [[1, 2, 3]]
    os.kill(os.getpid(), signal.SIGSTOP)  # hangs before it posts its next receive
else:
    announce([[1, 2, 3]], group, timedelta(seconds=2))
    started = time.monotonic()
    try:
        announce([[4, 5]], group, timedelta(seconds=2))
        print("SENT", flush=True)
    except RuntimeError as exc:
        print(f"RAISED after {time.monotonic() - started:.1f}s: {exc}", flush=True)
    os._exit(0)
"""


def test_rank_0_gives_up_on_a_hung_rank_after_its_timeout(tmp_path: Path) -> None:
    # Given: two gloo ranks with the replica's 30-day command group; rank 1 takes one row
    # and hangs before it asks for the next (a gloo broadcast's root waits for that)
    import os
    import subprocess
    import sys

    from datagen.redis_server import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    ranks = [subprocess.Popen([sys.executable, str(script), str(r)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in (0, 1)]
    try:
        # When: rank 0 announces the next row
        out, _ = ranks[0].communicate(timeout=120)
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    # Then: the announcement fails after the replica's timeout instead of waiting for ever
    # (the 30 days of the group), so rank 0 exits and the shard's lease can lapse
    assert "RAISED after" in out, out
    waited = float(out.split("RAISED after ")[1].split("s:")[0])
    assert 1.5 <= waited <= 10, out
