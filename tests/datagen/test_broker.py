"""The run's Redis transport (datagen/broker.py), against a real Redis and a real worker."""

from __future__ import annotations

import threading
from typing import Any

import redis
from conftest import Stack, wait_until, write_jsonl
from kombu import Connection, Queue

from config.settings import load_settings
from datagen import broker
from datagen.celery_app import GENERATE_TASK, make_app
from producers.producer import Producer


def _app(redis_url: str) -> Any:
    return make_app(load_settings(None, env={"DATAGEN_REDIS_URL": redis_url}))


def _take_one(app: Any, queue: str, r: redis.Redis) -> dict[str, Any]:
    """Consume one message of ``queue`` the way a worker does; note kombu's unacked hash
    while the message is held and after its ack."""
    seen: dict[str, Any] = {}
    with app.connection_for_read() as conn:
        def on_message(body: Any, message: Any) -> None:
            seen["held"] = r.hlen("unacked")
            message.ack()
            seen["after_ack"] = r.hlen("unacked")
        consumer = app.amqp.TaskConsumer(conn, queues=[Queue(queue)], callbacks=[on_message])
        seen["no_ack"] = bool(consumer.no_ack)
        with consumer:
            conn.drain_events(timeout=10)
    return seen


def test_every_queue_skips_the_unacked_bookkeeping(redis_url: str) -> None:
    app = _app(redis_url)
    r = redis.Redis.from_url(redis_url)
    for queue in ("short", "long", "gpu"):
        app.send_task(GENERATE_TASK, kwargs={"n": 1}, queue=queue)
    # taken with no_ack, so nothing is written to kombu's unacked hash, and the worker's ack
    # (Celery acks early) is a no-op rather than a second pipeline. gpu too: the extraction
    # ledger governs its re-runs, and a message left in `unacked` would come back after the
    # visibility timeout as a late duplicate.
    for queue in ("short", "long", "gpu"):
        assert _take_one(app, queue, r) == {"no_ack": True, "held": 0, "after_ack": 0}, queue
    assert r.llen("short") == r.llen("long") == r.llen("gpu") == 0
    assert r.zcard("unacked_index") == 0
    app.close()


def test_a_channel_keeps_one_redis_client(redis_url: str, monkeypatch: Any) -> None:
    app = _app(redis_url)
    made = []
    original = redis.Redis.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(1)
        original(self, *args, **kwargs)
    with app.connection_for_write() as conn:
        # the URL keeps its scheme (Flower picks its broker client by it)
        assert conn.as_uri().startswith("redis://")
        channel = conn.default_channel
        assert isinstance(channel, broker.Channel)
        with channel.conn_or_acquire() as a, channel.conn_or_acquire() as b:
            assert a is b
        producer = app.amqp.Producer(conn)
        app.send_task(GENERATE_TASK, kwargs={"n": 0}, queue="short", producer=producer)
        monkeypatch.setattr(redis.Redis, "__init__", counting)
        for i in range(50):
            app.send_task(GENERATE_TASK, kwargs={"n": i}, queue="short", producer=producer)
    monkeypatch.undo()
    # kombu's own channel builds a redis.Redis for every publish (50 here).
    assert len(made) == 0
    assert redis.Redis.from_url(redis_url).llen("short") == 51
    app.close()


def _drain_once(app: Any, free: int) -> tuple[list[Any], Any]:
    """One turn of a consumer of ``short`` whose worker has ``free`` more threads: the task
    bodies it was given, and its channel."""
    got: list[Any] = []
    with app.connection_for_read() as conn:
        consumer = app.amqp.TaskConsumer(conn, queues=[Queue("short")],
                                         callbacks=[lambda body, message: got.append(body)])
        channel = conn.default_channel
        channel.free_slots = lambda: free
        with consumer:
            conn.drain_events(timeout=10)
    return got, channel


def test_one_brpop_takes_as_many_more_messages_as_the_worker_has_free_threads(
        redis_url: str) -> None:
    app, r = _app(redis_url), redis.Redis.from_url(redis_url)
    for i in range(5):
        app.send_task(GENERATE_TASK, kwargs={"n": i}, queue="short")
    got, _ = _drain_once(app, free=2)
    assert [body[1]["n"] for body in got] == [0, 1, 2]  # in the queue's order
    assert r.llen("short") == 2
    app.close()


def test_a_redis_refusing_scripts_gives_one_message_per_brpop(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.acl_setuser("noscripts", enabled=True, passwords=["+pw"], keys=["*"], channels=["*"],
                  commands=["+@all", "-eval"])
    try:
        app = _app(redis_url.replace("redis://", "redis://noscripts:pw@", 1))
        for i in range(3):
            app.send_task(GENERATE_TASK, kwargs={"n": i}, queue="short")
        got, channel = _drain_once(app, free=2)
        assert len(got) == 1 and r.llen("short") == 2
        assert channel.free_slots is None  # not asked again
        app.close()
    finally:
        r.acl_deluser("noscripts")


def test_both_redis_schemes_resolve_to_this_transport(redis_url: str) -> None:
    _app(redis_url)
    for url in ("redis://localhost:6379/0", "rediss://localhost:6380/0?ssl_cert_reqs=required"):
        conn = Connection(url)
        assert isinstance(conn.transport, broker.Transport), url
        assert conn.as_uri().split("://")[0] == url.split("://")[0]


def test_a_worker_sends_every_task_event_in_a_few_messages(stack: Stack) -> None:
    # Given: a worker and a receiver of its events (what Flower runs)
    stack.start_simulator("--lengths", "fixed:20", "--decode-step-s", "0.001")
    samples = 40
    write_jsonl(stack.tmp / "partition" / "E1.jsonl",
                [{"id": f"e{i}", "prompt": f"Event {i}"} for i in range(samples)])
    settings = stack.configure(data_dir=str(stack.tmp / "partition"), short_concurrency=8,
                               short_max_tokens=32)
    stack.worker("short")
    stack.wait_workers(1)
    app = stack.app()
    events: dict[str, int] = {}
    lock = threading.Lock()

    def count(event: dict[str, Any]) -> None:
        with lock:
            events[event["type"]] = events.get(event["type"], 0) + 1
    r = redis.Redis.from_url(stack.redis_url)

    def subscriptions() -> int:
        return int(r.execute_command("PUBSUB", "NUMPAT")) + len(r.pubsub_channels())
    alone = subscriptions()
    conn = app.connection_for_read()
    receiver = app.events.Receiver(conn, handlers={"*": count})
    listening = threading.Thread(target=lambda: receiver.capture(limit=None, wakeup=False),
                                 daemon=True)
    listening.start()
    wait_until(lambda: subscriptions() > alone, 120, what="the event receiver to subscribe")

    def publishes() -> int:
        return int(r.info("commandstats").get("cmdstat_publish", {}).get("calls", 0))
    before = publishes()

    # When: the run's tasks go through the worker
    Producer(settings, app, stack.ledger()).run()
    wait_until(lambda: events.get("task-succeeded", 0) >= samples, 180)

    # Then: the receiver saw each task's received, started and succeeded events, though
    # the worker published them in far fewer messages than tasks (Celery's own flush,
    # once per turn of the event loop, sent 83 messages for these 40 tasks)
    receiver.should_stop = True
    assert events["task-received"] == events["task-started"] == samples
    assert events["task-succeeded"] == samples
    sent = publishes() - before
    assert sent < samples / 2, f"{sent} PUBLISH for {samples} tasks"
    conn.release()
    app.close()


def test_a_worker_fills_every_free_thread_from_one_brpop_and_takes_no_more(
        stack: Stack) -> None:
    # Given: 40 tasks queued before a worker of 8 threads starts, on a server that holds
    # each request ~30 s (3,000 tokens at 10 ms a step)
    stack.start_simulator("--lengths", "fixed:3000", "--decode-step-s", "0.01")
    samples, threads = 40, 8
    write_jsonl(stack.tmp / "partition" / "F1.jsonl",
                [{"id": f"f{i}", "prompt": f"Fill {i}"} for i in range(samples)])
    settings = stack.configure(data_dir=str(stack.tmp / "partition"),
                               short_concurrency=threads, short_max_tokens=3000)
    Producer(settings, stack.app(), stack.ledger()).run()
    r = redis.Redis.from_url(stack.redis_url)

    def queued() -> int:  # kombu keeps a list per priority: short, short\x06\x163, ...
        return sum(r.llen(key) for key in r.scan_iter(match="short*"))
    assert queued() == samples

    def calls(command: str) -> int:
        return int(r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))
    brpop = calls("brpop")

    # When: the worker starts
    stack.worker("short")
    wait_until(lambda: len({e["rid"] for e in stack.sim_log() if e["event"] == "start"})
               >= threads, 120, what=f"{threads} requests running on the server")

    # Then: one BRPOP (kombu's own takes one message per BRPOP and turn of the event loop:
    # 8 for 8 threads) and the messages it took with it filled every thread, and no more
    # left the queue than the worker had threads
    assert calls("brpop") - brpop <= 2
    assert queued() == samples - threads
    assert len({e["rid"] for e in stack.sim_log() if e["event"] == "start"}) == threads
