"""The extraction task on the `gpu` queue: a thin wrapper over datagen/extraction/runner.py.

Run one worker per GPU (``datagen worker gpu``: prefork, one child; ``CUDA_VISIBLE_DEVICES``
picks the GPU). The child loads the model once, on its first task, and keeps it. torch is
imported only inside functions: the short/long workers import this module too (through
workers.app) and must start without it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import signals

from datagen.celery_app import EXTRACT_TASK, app
from datagen.errors import BadInput
from datagen.extraction import runner
from datagen.extraction.estimate import InsufficientDiskSpace
from datagen.extraction.ledger import GPU_QUEUE, ExtractionLedger
from datagen.generation.ledger import connect

log = logging.getLogger(__name__)

_lock = threading.Lock()
_extractor: Any = None
_xledger: ExtractionLedger | None = None


def xledger() -> ExtractionLedger:
    global _xledger
    with _lock:
        if _xledger is None:
            _xledger = ExtractionLedger(connect(app.conf.datagen_settings.redis_url))
        return _xledger


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
        ex, _extractor = _extractor, None
    if ex is not None:
        try:
            ex.close()
        except Exception:  # noqa: BLE001 - already failing; the reload is what matters
            log.exception("closing the extractor after a failure")


@signals.worker_process_shutdown.connect
def _close_extractor(**_: object) -> None:
    if _extractor is not None:
        _extractor.close()  # drains the writer threads: no file is left half-renamed


@app.task(name=EXTRACT_TASK, bind=True, queue=GPU_QUEUE)
def extract(self, shard: str, **_: object) -> dict[str, Any]:
    settings = app.conf.datagen_settings
    try:
        return runner.run(settings, xledger(), extractor, shard)
    except (InsufficientDiskSpace, BadInput) as exc:  # a retry in a few seconds cannot help
        return runner.give_up(settings, xledger(), shard, exc)
    except Exception as exc:
        log.exception("shard %s failed (try %d)", shard, self.request.retries + 1)
        if "cuda" in f"{type(exc).__name__} {exc}".lower():
            drop_extractor()  # the device may be in a bad state: the retry reloads the model
        if self.request.retries >= settings.extract_max_retries:
            return runner.give_up(settings, xledger(), shard, exc)
        raise self.retry(exc=exc, countdown=settings.extract_retry_countdown_s,
                         max_retries=settings.extract_max_retries, queue=GPU_QUEUE) from exc
