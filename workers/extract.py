"""The extraction task on the `gpu` queue: one shard of the training set per message.

Run one worker per GPU (``datagen worker gpu``: prefork, one child; ``CUDA_VISIBLE_DEVICES``
picks the GPU). The child loads the model once, on its first task, and keeps it. torch is
imported here only inside functions: the short/long workers import this module too (through
workers.app) and must start without it.

A task: check (done for this content? another worker on it?) -> run the shard -> dead-letter
the samples that failed alone -> mark the shard done. A whole-shard failure (a crash, a disk
error) is retried by Celery with a countdown, ``extract_max_retries`` times, then the shard is
dead-lettered with its reason; either way the task returns and the queue moves on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from celery import signals

from config.settings import Settings
from datagen.celery_app import EXTRACT_TASK, app
from datagen.errors import BadInput
from datagen.estimate import InsufficientDiskSpace
from datagen.extraction_ledger import GPU_QUEUE, ExtractionLedger
from datagen.generation.ledger import connect
from datagen.training_set import extraction_dir

log = logging.getLogger(__name__)

DEAD_LETTERS = "dead_letters.jsonl"  # in the extraction folder, one JSON line per failure

_lock = threading.Lock()
_extractor: Any = None
_xledger: ExtractionLedger | None = None


def worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def xledger() -> ExtractionLedger:
    global _xledger
    with _lock:
        if _xledger is None:
            _xledger = ExtractionLedger(connect(app.conf.datagen_settings.redis_url))
        return _xledger


def extraction_config(settings: Settings) -> Any:
    from workers.extraction import ExtractionConfig  # torch loads here

    threads = settings.extract_writer_threads
    return ExtractionConfig(
        model_path=settings.model_path, output_dir=str(extraction_dir(settings)),
        aux_layer_ids=tuple(settings.aux_layer_ids) if settings.aux_layer_ids else None,
        dtype=settings.extract_dtype, device=settings.extract_device,
        max_length=settings.train_max_length, overlong=settings.extract_overlong,
        batch_tokens=settings.extract_batch_tokens,
        attn_implementation=settings.extract_attn_implementation,
        trust_remote_code=settings.trust_remote_code, file_format=settings.extract_file_format,
        writer_threads=threads, max_pending_writes=2 * threads)


def extractor() -> Any:
    """The process's Extractor: the model loads on the first task and stays."""
    global _extractor
    with _lock:
        if _extractor is None:
            from workers.extraction import Extractor

            settings = app.conf.datagen_settings
            if not settings.model_path:
                raise ValueError("model_path is not set (DATAGEN_MODEL_PATH or the TOML file)")
            _extractor = Extractor(extraction_config(settings))
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


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dead_letter(settings: Settings, entries: list[dict[str, Any]]) -> None:
    """Append failures to <extraction_dir>/dead_letters.jsonl (one write per batch of lines)."""
    if not entries:
        return
    folder = extraction_dir(settings)
    folder.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries).encode()
    fd = os.open(folder / DEAD_LETTERS, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def result_entry(result: Any, sha256: str) -> dict[str, Any]:
    return {"sha256": sha256, "samples": result.written + result.skipped_done,
            "written": result.written, "skipped_done": result.skipped_done,
            "skipped_overlong": result.skipped_overlong, "truncated": result.truncated,
            "failed": len(result.failures), "tokens": result.tokens, "bytes": result.bytes,
            "seconds": round(result.seconds, 3), "overlong_ids": result.overlong_ids[:20],
            "worker": worker_id(), "time": time.time()}


def _reporter(xl: ExtractionLedger, shard: str, me: str) -> Any:
    def report(handled: int, total: int) -> None:
        try:
            xl.progress(shard, handled, total, me)
        except Exception as exc:  # noqa: BLE001 - progress is for display; the run goes on
            log.warning("progress of %s not recorded: %s", shard, exc)
    return report


def run(shard: str) -> dict[str, Any]:
    """Run one shard and persist its outcome; exceptions are the caller's to retry."""
    settings = app.conf.datagen_settings
    xl, me = xledger(), worker_id()
    if Path(shard).is_absolute() or ".." in Path(shard).parts:
        raise BadInput(f"shard {shard!r} is not a path inside the output folder")
    path = Path(settings.output_dir) / shard
    sha = file_sha256(path)
    if xl.is_done(shard, sha):
        return {"status": "done before"}
    with xl.lease(shard, me, settings.lease_s) as held:
        if not held:
            return {"status": "busy"}  # a live worker runs it; this message is a duplicate
        if xl.is_done(shard, sha):  # finished between the check and the lease
            return {"status": "done before"}
        result = extractor().run_shard(path, progress=_reporter(xl, shard, me))
        now = time.time()
        dead_letter(settings, [{"kind": "sample", "shard": shard, "idx": f.idx, "id": f.id,
                                "reason": f.reason, "worker": me, "time": now}
                               for f in result.failures])
        entry = result_entry(result, sha)
        xl.mark_done(shard, entry, len(result.failures))
    return {"status": "done", **entry}


def give_up(shard: str, exc: BaseException) -> dict[str, Any]:
    settings = app.conf.datagen_settings
    reason = f"{type(exc).__name__}: {exc}"
    log.error("shard %s dead-lettered: %s", shard, reason)
    path = Path(settings.output_dir) / shard
    readable = not isinstance(exc, BadInput) and path.is_file()
    sha = file_sha256(path) if readable else ""
    dead_letter(settings, [{"kind": "shard", "shard": shard, "idx": None, "id": None,
                            "reason": reason, "worker": worker_id(), "time": time.time()}])
    xledger().mark_dead(shard, sha, reason, worker_id())
    return {"status": "dead", "reason": reason}


@app.task(name=EXTRACT_TASK, bind=True, queue=GPU_QUEUE)
def extract(self, shard: str, **_: object) -> dict[str, Any]:
    settings = app.conf.datagen_settings
    try:
        return run(shard)
    except (InsufficientDiskSpace, BadInput) as exc:  # a retry in a few seconds cannot help
        return give_up(shard, exc)
    except Exception as exc:
        log.exception("shard %s failed (try %d)", shard, self.request.retries + 1)
        if "cuda" in f"{type(exc).__name__} {exc}".lower():
            drop_extractor()  # the device may be in a bad state: the retry reloads the model
        if self.request.retries >= settings.extract_max_retries:
            return give_up(shard, exc)
        raise self.retry(exc=exc, countdown=settings.extract_retry_countdown_s,
                         max_retries=settings.extract_max_retries, queue=GPU_QUEUE) from exc
