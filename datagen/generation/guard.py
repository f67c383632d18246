"""The budget guard's actions: enqueue with stamps, close a dataset, reopen it.

The Redis flag checked at task start (``admit.lua``) is what guarantees a closed
dataset sends no new request, on any host, including workers that join later.
Whoever sees a dataset close (the commit that reached the budget, an admission that
found it over, ``datagen budget``) runs ``on_closed``: the close event, one stamped
revoke so workers drop its queued tasks without even reading the flag (revokes are
not persisted and miss workers that join later: the flag still holds), its pending
payloads dropped, and with ``abort_on_close`` one ``/abort_request`` per server with
the dataset's rid prefix, which aborts all of its requests there at once.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from config.settings import masked_url
from datagen import keys
from datagen.celery_app import GENERATE_TASK
from datagen.client import SGLangClient, rid_prefix
from datagen.generation.job import Job
from datagen.generation.ledger import Ledger

log = logging.getLogger(__name__)

STAMP_HEADER = "dg_epoch"


def enqueue(app: Celery, job: Job, producer: Any = None, retry: bool = False) -> None:
    """Send one job; ``retry`` (work that came back) goes ahead of fresh work."""
    # A short kwargsrepr: Celery would otherwise saferepr the payload into every message
    # (~200 bytes of Redis memory per queued prompt, and most of the publishing time).
    app.send_task(GENERATE_TASK, kwargs=job.payload(), queue=job.queue, producer=producer,
                  argsrepr="", kwargsrepr=f"{job.dataset}/{job.sample}",
                  priority=keys.RETRY_PRIORITY if retry else keys.FRESH_PRIORITY,
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
    """One ``/abort_request`` with the dataset's rid prefix to each server running its
    requests; their workers then discard the partial outputs. Returns the servers asked."""
    servers = {entry.get("server") or ledger.settings.server_url
               for entry in ledger.in_flight(dataset).values()}
    for server in servers:
        client = SGLangClient(_unmasked(server, ledger), ledger.settings.api_key, 5.0, 30.0)
        client.abort(rid_prefix(dataset))
    return len(servers)


def _unmasked(server: str, ledger: Ledger) -> str:
    # Entries carry the server's masked URL (no password in Redis); the settings' own
    # server_url is the one with credentials.
    own = ledger.settings.server_url
    return own if masked_url(own) == server else server
