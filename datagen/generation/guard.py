"""The budget guard's actions: enqueue with stamps, close a dataset, reopen it.

The Redis flag checked at task start (``admit.lua``) is what guarantees a closed
dataset sends no new request, on any host, including workers that join later.
Whoever sees a dataset close (the commit that reached the budget, an admission that
found it over, ``datagen budget``) runs ``on_closed``: the close event; with
``abort_on_close`` one ``/abort_request`` per request in flight, with its exact rid, to the
server its ledger entry names; one stamped revoke so workers drop its queued tasks without
even reading the flag (revokes are not persisted and miss workers that join later: the
flag still holds); its pending payloads dropped. SGLang 0.5.23 (default
``--tokenizer-worker-num 1``) looks an abort's rid up exactly and drops one it does not
run, so a rid prefix aborts nothing; the aborts go out side by side, from a thread pool.
A request admitted just before the close may reach its server only after its abort
(dropped as unknown then): a second pass ABORT_REPEAT_S later aborts the entries still
in flight.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from celery import Celery

from config.settings import Settings, masked_url
from datagen import keys
from datagen.celery_app import GENERATE_TASK
from datagen.client import SGLangClient
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
    """Everything that follows a close: optionally abort in flight, revoke queued tasks,
    drop their pending payloads (nothing redoes them: the sweep skips a closed dataset, a
    reopen enqueues anew).

    The aborts go first: each request in flight spends the server's tokens until it is
    aborted, while a queued task cannot start once the flag is set. (Seen on a loaded
    2-core runner: the revoke broadcast took longer than the requests had left to run, so
    an abort sent after it found nothing in flight.)"""
    epoch = ledger.epoch(dataset)
    ledger.event(dataset, f"closed:{reason}")
    if abort_in_flight:
        abort_in_flight_requests(ledger, dataset)
    log.info("%s closed (%s): revoking its queued tasks", dataset, reason)
    try:
        app.control.revoke_by_stamped_headers({STAMP_HEADER: f"{dataset}#{epoch}"})
    except Exception as exc:  # the flag still holds; the revoke only saves time
        log.warning("stamped revoke for %s failed: %s", dataset, exc)
    ledger.drop_pending(dataset)


def close(app: Celery, ledger: Ledger, dataset: str, reason: str,
          abort_in_flight: bool = False) -> bool:
    if not ledger.close(dataset, reason):
        return False
    on_closed(app, ledger, dataset, reason, abort_in_flight)
    return True


# Aborts sent at once: each is one short HTTP call (two behind a router); a close with
# hundreds in flight should not abort them one after another.
ABORT_THREADS = 32
# When the close's second pass aborts the requests still in flight (see the docstring).
ABORT_REPEAT_S = 1.0


def abort_in_flight_requests(ledger: Ledger, dataset: str, repeat: bool = True) -> int:
    """``/abort_request`` with its exact rid for each of the dataset's requests in flight,
    at the server its entry names; their workers then discard the partial outputs.
    Returns the requests aborted (a second pass follows in a thread unless ``repeat``)."""
    entries = ledger.in_flight(dataset)
    count = abort_entries(ledger, entries.values())
    if count and repeat:
        later = threading.Timer(ABORT_REPEAT_S, _abort_again,
                                args=(ledger, dataset, {s: e.get("rid") for s, e in
                                                        entries.items()}))
        later.start()
        _PASSES[:] = [t for t in _PASSES if t.is_alive()] + [later]  # a worker's stay few
    log.info("%s: aborted %d requests in flight", dataset, count)
    return count


# Second passes not run yet. A worker lives on; a command that closes and exits (`datagen
# budget`) waits for them, or interpreter shutdown would refuse their thread pool.
_PASSES: list[threading.Timer] = []


def wait_for_abort_passes() -> None:
    """Until every second abort pass started in this process has run."""
    while _PASSES:
        _PASSES.pop().join()


def _abort_again(ledger: Ledger, dataset: str, first: dict[str, Any]) -> None:
    try:
        entries = ledger.in_flight(dataset)
    except Exception as exc:  # Redis away: the first pass stands
        log.warning("second abort pass for %s: %s", dataset, exc)
        return
    abort_entries(ledger, [e for s, e in entries.items() if first.get(s) == e.get("rid")])


def abort_entries(ledger: Ledger, entries: Iterable[Mapping[str, Any]]) -> int:
    """Abort the requests of in-flight entries (``{"rid", "server", ...}``, as the ledger
    holds them) at the servers they name; returns how many."""
    return abort_requests(ledger.settings, [
        (_unmasked(e.get("server") or ledger.settings.server_url, ledger), str(e["rid"]))
        for e in entries if e.get("rid")])


def abort_requests(settings: Settings, targets: Iterable[tuple[str, str]]) -> int:
    """Abort each (server URL, rid) by its exact rid, concurrently; one client per server
    (behind a router it sends each abort to every server the router lists)."""
    targets = list(targets)
    if not targets:
        return 0
    clients = {server: SGLangClient(server, settings.api_key, 5.0, 30.0, settings.server_kind)
               for server in {server for server, _ in targets}}
    with ThreadPoolExecutor(min(ABORT_THREADS, len(targets)),
                            thread_name_prefix="abort") as pool:
        list(pool.map(lambda t: clients[t[0]].abort(t[1]), targets))
    return len(targets)


def _unmasked(server: str, ledger: Ledger) -> str:
    # Entries carry the server's masked URL (no password in Redis); the settings' own
    # server_url is the one with credentials.
    own = ledger.settings.server_url
    return own if masked_url(own) == server else server
