"""The generation task on the `short` and `long` queues: a thin wrapper over the core."""

from __future__ import annotations

import json
import logging
import threading
from functools import partial
from typing import Any

from celery import signals
from celery.exceptions import Ignore

from datagen.celery_app import GENERATE_TASK, app
from datagen.generation.guard import enqueue, on_closed
from datagen.generation.job import Job
from datagen.generation.liveness import Heartbeat
from datagen.generation.runner import STOPPING, Context, Outcome, run_job

log = logging.getLogger(__name__)

_lock = threading.Lock()
_context: Context | None = None
_heartbeat: Heartbeat | None = None
_paused: list[str] = []  # the queues it stopped consuming while its server was lost


def context() -> Context:
    """The process's context, built once on first use (threads share it)."""
    global _context
    with _lock:
        if _context is None:
            _context = Context.create(app.conf.datagen_settings)
        return _context


def requeue(job: Job) -> None:
    """Work that comes back (reaped, woken, handed back) goes ahead of fresh work."""
    enqueue(app, job, retry=True)


@signals.worker_ready.connect
def _start_heartbeat(sender: Any = None, **_: object) -> None:
    global _heartbeat
    ctx = context()
    _heartbeat = Heartbeat(ctx.ledger, ctx.leases, ctx.settings.lease_s, requeue,
                           server_ok=ctx.client.reachable,
                           on_server=partial(_consume, sender))
    _heartbeat.start()


def _consume(consumer: Any, server_reachable: bool) -> None:
    """Stop taking tasks while the server cannot be reached from here, take them again
    once it can: the samples go to workers that reach theirs. Requests waiting on the lost
    server are dropped: their threads hand the samples back now, and nothing still on its
    way can reach the server after the network heals."""
    if not server_reachable and _context is not None:
        dropped = _context.client.drop_in_flight()
        if dropped:
            log.warning("dropped %d requests waiting on the unreachable server", dropped)
    hostname = getattr(consumer, "hostname", None)
    if server_reachable:  # the queues it stopped consuming (its consumer lists none now)
        queues, _paused[:] = list(_paused), []
    else:
        queues = [q.name for q in getattr(getattr(consumer, "task_consumer", None), "queues",
                                          [])]
        _paused[:] = queues
    if not hostname or not queues:
        return
    for queue in queues:
        if server_reachable:
            app.control.add_consumer(queue, destination=[hostname])
        else:
            app.control.cancel_consumer(queue, destination=[hostname])
    log.warning("%s %s", "consuming again from" if server_reachable else "stopped consuming",
                ", ".join(queues))


@signals.worker_shutting_down.connect
def _hand_back(**_: object) -> None:
    """SIGTERM: start nothing new; after the grace period abort what is still in flight,
    so its tasks return and re-enqueue their samples before the process exits."""
    STOPPING.set()
    if _context is None:
        return
    ctx = _context
    timer = threading.Timer(ctx.settings.shutdown_grace_s, abort_own_requests, args=(ctx,))
    timer.daemon = True
    timer.start()


def abort_own_requests(ctx: Context) -> int:
    rids = ctx.leases.rids()
    for rid in rids:
        ctx.client.abort(rid)
    log.warning("shutdown: aborted %d in-flight requests; their samples are re-enqueued",
                len(rids))
    return len(rids)


@signals.worker_shutdown.connect
def _stop_heartbeat(**_: object) -> None:
    if _heartbeat is not None:
        _heartbeat.stop()
    if _context is not None:
        _context.writer.close()


@signals.task_revoked.connect
def _count_revoked(request: object = None, **_: object) -> None:
    """Tasks the stamped revoke dropped before they ran count as revoked in status too."""
    kwargs = getattr(request, "kwargs", None) or {}
    dataset = kwargs.get("dataset") if isinstance(kwargs, dict) else None
    if dataset:
        try:
            context().ledger.count(str(dataset), "revoked")
        except Exception as exc:  # a status counter must never break the worker
            log.warning("could not count a revoked task of %s: %s", dataset, exc)


@app.task(name=GENERATE_TASK, bind=True)
def generate(self, **payload: object) -> str:
    job = Job.from_payload(payload)
    ctx = context()
    outcome = run_job(ctx, job)
    _follow_up(ctx, job, outcome)
    if outcome.status == "waiting":
        # Parked in the ledger until a commit or release wakes it: shown as WAITING.
        self.send_event("task-waiting", dataset=job.dataset, sample=job.sample)
        raise Ignore()
    if outcome.status == "dead":
        # Dead-lettered: a failure to an operator (Flower counts it as failed), without a
        # traceback or a retry; the reason is in the ledger (`datagen dead`).
        self.send_event("task-failed", exception=f"dead letter: {outcome.detail}",
                        traceback=None)
        raise Ignore()
    if outcome.status == "closed":
        # Shown as revoked in Flower, like tasks the stamped revoke caught.
        self.send_event("task-revoked", terminated=False, signum=None, expired=False)
        ctx.ledger.count(job.dataset, "revoked")
        raise Ignore()
    return outcome.status


def _follow_up(ctx: Context, job: Job, outcome: Outcome) -> None:
    """What the outcome asks of the worker: close actions, woken and handed-back work."""
    if outcome.closed_now:
        reason = ctx.ledger.closed(job.dataset) or "budget"  # or max_samples
        on_closed(app, ctx.ledger, job.dataset, reason, ctx.settings.abort_on_close)
    for payload in outcome.woken:
        requeue(Job.from_payload(json.loads(payload)))
    if outcome.status == "requeue":
        requeue(job)
