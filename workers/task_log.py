"""Celery's two INFO lines per task, at DEBUG only on the generation queues.

Celery logs "Task … received" as it takes a message and "Task … succeeded in …" as the
task returns. A short worker on a fast server runs a few hundred tasks a second, 150
threads each making, formatting and writing two records under the log handler's one lock:
5% of the samples of a py-spy profile of the worker holding the GIL, and 5-10% less worker
CPU per sample without them, measured side by side (BENCHMARKS.md, "The queue's cost since
the claims and the window, side by side"), for lines nobody reads at that rate. What an
operator acts on is logged by the runner at WARNING (retries, dead letters, a lost server, a
stored sample that lapsed); Flower shows every task (its events are unchanged), the ledger
counts every outcome (``datagen status``). A worker with ``log_each_task`` on, or started
with ``--loglevel DEBUG``, logs both lines again; a gpu worker always does (one line per
shard, minutes apart).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals

# Celery's loggers of the two lines (celery/worker/strategy.py and celery/app/trace.py):
# each reads its level once, when the worker builds its strategies and tracers.
PER_TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace")
QUIET_QUEUES = frozenset({"short", "long"})


def per_task_lines_quieted(queues: set[str], loglevel: int, log_each_task: bool) -> bool:
    """Whether a worker consuming ``queues`` at ``loglevel`` logs its tasks at DEBUG only."""
    return (not log_each_task and bool(queues) and queues <= QUIET_QUEUES
            and loglevel > logging.DEBUG)


@signals.celeryd_after_setup.connect
def _quiet_per_task_lines(sender: Any = None, instance: Any = None, **_: object) -> None:
    """After ``-Q`` and the logging set-up, before the consumer builds its strategies."""
    if instance is None:
        return
    queues = set(instance.app.amqp.queues.consume_from)
    settings = instance.app.conf.datagen_settings
    if per_task_lines_quieted(queues, int(instance.loglevel), settings.log_each_task):
        for name in PER_TASK_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
