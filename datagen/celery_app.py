"""The one Celery app of a run, built from the one Settings object.

The producer, every worker and Flower call ``make_app`` with the same settings:
kombu restores unacked messages older than the *shortest* visibility_timeout of
any client on the Redis database, so a process with other settings would make
live workers' tasks run twice.
"""

from __future__ import annotations

import sys

from celery import Celery
from kombu import Queue

from config.settings import Settings, load_settings
from datagen import broker

GENERATE_TASK = "datagen.generate"
EXTRACT_TASK = "datagen.extract"
QUEUES = ("short", "long", "gpu")
# kombu's Redis transport: replies within 5 s (its BRPOP waits 1 s), connects within 3 s,
# and its BRPOP and pub/sub connections checked every 4 s, so a consumer on a connection cut
# silently reconnects within about 10 s instead of waiting on it forever.
BROKER_SOCKET_OPTIONS = {"socket_timeout": 5.0, "socket_connect_timeout": 3.0,
                         "socket_keepalive": True, "health_check_interval": 4}


def celery_config(settings: Settings) -> dict[str, object]:
    return {
        "broker_url": settings.redis_url,
        "broker_connection_retry_on_startup": True,
        # Early ack + no prefetch: each message runs once (DESIGN.md, facts); work lost
        # when a worker dies is found through the ledger's in-flight leases.
        "task_acks_late": False,
        "worker_prefetch_multiplier": 1,
        "worker_disable_prefetch": True,
        # Every socket with a timeout and keepalive: a broker cut silently (packets dropped,
        # no reset) must not block a publish or a fetch for minutes (RELIABILITY.md).
        "broker_transport_options": {"visibility_timeout": settings.visibility_timeout_s,
                                     **BROKER_SOCKET_OPTIONS},
        "task_ignore_result": True,
        "result_backend": None,
        "task_serializer": "json",
        "accept_content": ["json"],
        "task_queues": [Queue(name) for name in QUEUES],
        "task_default_queue": "short",
        "task_create_missing_queues": False,
        # Flower sees every task only with events on, in workers and at send time.
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "worker_hijack_root_logger": False,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
    }


def make_app(settings: Settings) -> Celery:
    # kombu's Redis transport less a client per call and the queues' unacked bookkeeping,
    # Celery's events in batches (datagen/broker.py says why, and what it saves).
    broker.install()
    app = Celery("datagen", set_as_current=False, amqp="datagen.broker:NoAckAMQP",
                 events="datagen.broker:Events")
    app.conf.update(celery_config(settings))
    app.steps["consumer"].add(broker.TakeFreeSlots)
    app.conf.datagen_settings = settings
    return app


# For `celery -A datagen.celery_app flower` and `inspect`: settings from the environment.
app = make_app(load_settings())


def worker_argv(settings: Settings, queue: str, hostname: str | None = None) -> list[str]:
    """The `celery worker` command for a queue; concurrency comes from the settings only.

    short/long: the threads pool (I/O-bound HTTP; ~66 MB at 150 threads against ~3.9 GB
    for prefork, DESIGN.md facts). gpu: prefork with one child, one worker per GPU.
    """
    name = hostname or f"{queue}@%h"
    base = [sys.executable, "-m", "celery", "-A", "workers.app", "worker", "-Q", queue, "-n", name,
            "--loglevel", "INFO", "-E"]
    if queue == "gpu":
        return base + ["-P", "prefork", "-c", "1"]
    concurrency, _ = settings.queue_limits(queue)
    return base + ["-P", settings.worker_pool, "-c", str(concurrency)]
