"""The budget guard's actions: enqueue with stamps, close a dataset, reopen it.

The Redis flag checked at task start (``admit.lua``) is what guarantees a closed
dataset sends no new request, on any host, including workers that join later.
A stamped revoke is only the accelerator: one broadcast per dataset, so workers
drop its queued tasks without even reading the flag (REFERENCE §4: revokes are
not persisted and miss workers that join later).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from datagen.celery_app import GENERATE_TASK
from datagen.client import SGLangClient
from datagen.generation.job import Job
from datagen.generation.ledger import Ledger

log = logging.getLogger(__name__)

STAMP_HEADER = "dg_epoch"


def enqueue(app: Celery, job: Job, producer: Any = None) -> None:
    # A short kwargsrepr: Celery would otherwise saferepr the payload into every message
    # (~200 bytes of Redis memory per queued prompt, and most of the publishing time).
    app.send_task(GENERATE_TASK, kwargs=job.payload(), queue=job.queue, producer=producer,
                  argsrepr="", kwargsrepr=f"{job.dataset}/{job.sample}",
                  stamped_headers=[STAMP_HEADER], **{STAMP_HEADER: job.stamp})


def on_closed(app: Celery, ledger: Ledger, dataset: str, reason: str,
              abort_in_flight: bool = False) -> None:
    """Everything that follows a close: revoke queued tasks, drop their pending payloads
    (nothing redoes them: the sweep skips a closed dataset, a reopen enqueues anew),
    optionally abort in flight."""
    epoch = ledger.epoch(dataset)
    ledger.event(dataset, f"closed:{reason}")
    log.info("%s closed (%s): revoking its queued tasks", dataset, reason)
    try:
        app.control.revoke_by_stamped_headers({STAMP_HEADER: f"{dataset}#{epoch}"})
    except Exception as exc:  # the flag still holds; the revoke only saves time
        log.warning("stamped revoke for %s failed: %s", dataset, exc)
    ledger.drop_pending(dataset)
    if abort_in_flight:
        abort_in_flight_requests(ledger, dataset)


def close(app: Celery, ledger: Ledger, dataset: str, reason: str,
          abort_in_flight: bool = False) -> bool:
    if not ledger.close(dataset, reason):
        return False
    on_closed(app, ledger, dataset, reason, abort_in_flight)
    return True


def abort_in_flight_requests(ledger: Ledger, dataset: str) -> int:
    """Ask each in-flight request's server to abort it; the worker then discards it."""
    entries = ledger.in_flight(dataset)
    by_server: dict[str, list[str]] = {}
    for entry in entries.values():
        by_server.setdefault(entry.get("server") or ledger.settings.server_url, []).append(
            entry["rid"])
    for server, rids in by_server.items():
        client = SGLangClient(server, ledger.settings.api_key, 5.0, 30.0)
        for rid in rids:
            client.abort(rid)
    return len(entries)
