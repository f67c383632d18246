"""The extraction task on the `gpu` queue: a thin wrapper over datagen/extraction/runner.py.

One gpu worker is one model replica. On one device (``datagen worker gpu``: prefork, one
child; ``CUDA_VISIBLE_DEVICES`` picks the GPU) the child loads the model on its first task and
keeps it. A replica over several ranks (``--gpus 0-7``, datagen/extraction/replica.py) loads
it before consuming and installs its extractor here. torch is imported only inside functions:
the short/long workers import this module too (through workers.app) and must start without it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import signals

from datagen.celery_app import EXTRACT_TASK, app
from datagen.errors import BadInput, EngineLost
from datagen.extraction import runner
from datagen.extraction.estimate import InsufficientDiskSpace
from datagen.extraction.ledger import GPU_QUEUE, ExtractionLedger
from datagen.generation.ledger import connect

log = logging.getLogger(__name__)

_lock = threading.Lock()
_extractor: Any = None
_installed = False  # a replica's extractor: never dropped and reloaded here
_xledger: ExtractionLedger | None = None
_reaper_stop = threading.Event()


def xledger() -> ExtractionLedger:
    global _xledger
    with _lock:
        if _xledger is None:
            _xledger = ExtractionLedger(connect(app.conf.datagen_settings.redis_url))
        return _xledger


def install(extractor: Any) -> None:
    """A replica's rank 0: the extractor over all ranks, built before the worker starts."""
    global _extractor, _installed
    with _lock:
        _extractor, _installed = extractor, True


def extractor() -> Any:
    """The process's Extractor: the model loads on the first task and stays."""
    global _extractor
    with _lock:
        if _extractor is None:
            from datagen.extraction.extractor import Extractor

            settings = app.conf.datagen_settings
            if not settings.model_path:
                raise ValueError("model_path is not set (DATAGEN_MODEL_PATH or the TOML file)")
            _extractor = Extractor(runner.extraction_config(settings))
        return _extractor


def drop_extractor() -> None:
    """Forget the model after a failure that may have left it unusable; the retry reloads."""
    global _extractor
    with _lock:
        if _installed:
            return
        ex, _extractor = _extractor, None
    if ex is not None:
        try:
            ex.close()
        except Exception:  # noqa: BLE001 - already failing; the reload is what matters
            log.exception("closing the extractor after a failure")


def _send(shard: str, retry: bool) -> None:
    runner.send_shard(app, shard, retry)


def _reap_loop() -> None:
    """In the process that consumes (a prefork worker's parent, a replica's rank 0), beside
    the task: it reaps while a shard runs. Its own ledger client, not ``xledger()``: a
    prefork child forked while this thread held ``_lock`` would find it held for ever."""
    settings = app.conf.datagen_settings
    xl = ExtractionLedger(connect(settings.redis_url))
    period = min(1.0, settings.lease_s / 3)
    log.info("extraction reaper of %s: every %.1fs", runner.worker_id(), period)
    while not _reaper_stop.wait(period):
        try:
            runner.reap(settings, xl, _send)
        except Exception as exc:  # noqa: BLE001 - Redis away: try again next tick
            log.warning("extraction reaper: %s", exc)


@signals.worker_ready.connect
def _start_reaper(sender: Any = None, **_: object) -> None:
    """Every gpu worker reaps: a shard whose run died is re-enqueued about one lease after,
    with or without `datagen extract` following the run."""
    queues = getattr(getattr(app.amqp, "queues", None), "consume_from", None) or {}
    if GPU_QUEUE in queues:
        threading.Thread(target=_reap_loop, name="extract-reaper", daemon=True).start()


@signals.worker_shutdown.connect
def _stop_reaper(**_: object) -> None:
    _reaper_stop.set()


@signals.worker_process_shutdown.connect
def _close_extractor(**_: object) -> None:
    if _extractor is not None and not _installed:
        _extractor.close()  # drains the writer threads: no file is left half-renamed


@app.task(name=EXTRACT_TASK, bind=True, queue=GPU_QUEUE)
def extract(self, shard: str, **_: object) -> dict[str, Any]:
    settings = app.conf.datagen_settings
    try:
        return runner.run(settings, xledger(), extractor, shard)
    except (InsufficientDiskSpace, BadInput) as exc:  # a retry in a few seconds cannot help
        return runner.give_up(settings, xledger(), shard, exc)
    except Exception as exc:
        if isinstance(exc, EngineLost) or "cuda" in f"{type(exc).__name__} {exc}".lower():
            drop_extractor()  # the device or engine may be unusable: the retry reloads it
        return runner.fail(settings, xledger(), shard, exc)
