"""One shard of the training set, start to end: the core of the `gpu` task (workers/extract.py).

A run: check (done for this content? another worker on it?) -> run the shard -> dead-letter
the samples that failed alone -> mark the shard done. Exceptions are the caller's: the task
retries a whole-shard failure (a crash, a disk error) with a countdown, then calls ``give_up``,
which dead-letters the shard with its reason; either way the queue moves on. torch is imported
here only inside functions: the short/long workers import the task module too and must start
without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from config.settings import Settings
from datagen import keys
from datagen.celery_app import EXTRACT_TASK
from datagen.errors import BadInput
from datagen.extraction.ledger import GPU_QUEUE, ExtractionLedger, done_version
from datagen.extraction.tally import DEAD_LETTERS
from datagen.stream.ledger import require_epoch, stream_dir
from datagen.training.training_set import extraction_dir

log = logging.getLogger(__name__)



Send = Callable[[str, bool], None]  # (shard, retry?) -> one message on the gpu queue


def send_shard(app: Any, shard: str, retry: bool = False) -> None:
    """One message for a shard; a shard that comes back goes ahead of fresh ones. Its ledger
    entry is written first (``enqueue``, or the reaper's ``requeued``)."""
    app.send_task(EXTRACT_TASK, kwargs={"shard": shard}, queue=GPU_QUEUE,
                  priority=keys.RETRY_PRIORITY if retry else keys.FRESH_PRIORITY)


def enqueue(app: Any, xl: ExtractionLedger, shards: list[str], retry: bool = False) -> None:
    """Send shards that have no entry yet: entries first, so the ledger knows each message
    even once a worker has taken it from Redis (the gpu queue has no acks)."""
    xl.sent(shards)
    for shard in shards:
        send_shard(app, shard, retry)


def worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def extraction_config(settings: Settings) -> Any:
    from datagen.extraction.backends.vllm import EngineOptions  # torch loads here
    from datagen.extraction.devices import parse_gpus
    from datagen.extraction.extractor import ExtractionConfig

    threads = settings.extract_writer_threads
    engine = EngineOptions(
        python=settings.vllm_python, args=settings.vllm_args, inflight=settings.vllm_inflight,
        start_timeout_s=settings.vllm_start_timeout_s,
        tensor_parallel=parse_gpus(settings.gpus).ranks if settings.gpus else 1)
    return ExtractionConfig(
        model_path=settings.model_path, output_dir=str(extraction_dir(settings)),
        aux_layer_ids=tuple(settings.aux_layer_ids) if settings.aux_layer_ids else None,
        dtype=settings.extract_dtype, device=settings.extract_device,
        max_length=settings.train_max_length, overlong=settings.extract_overlong,
        batch_tokens=settings.extract_batch_tokens,
        attn_implementation=settings.extract_attn_implementation,
        trust_remote_code=settings.trust_remote_code,
        writer_threads=threads, max_pending_writes=2 * threads, backend=settings.extract_backend,
        engine=engine, run_dir=settings.output_dir, check_states=settings.check_states,
        check_positions_cpu=settings.check_positions_cpu,
        check_atol_nats=settings.check_atol_nats, server_dtype=settings.server_dtype,
        recapture_share=settings.recapture_share, server_url=settings.server_url,
        api_key=settings.api_key,
        keep_captured_states=settings.keep_captured_states,
        states_to=settings.states_to, stream_dir=str(stream_dir(settings)),
        stream_resident_bytes=settings.stream_resident_bytes, epoch=settings.stream_epoch,
        shuffle_seed=settings.shuffle_seed, redis_url=settings.redis_url)


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


def check_fields(check: Any) -> dict[str, Any]:
    """A failed state check's numbers for its dead letter (what the run's total reads)."""
    if check is None:
        return {}
    fields = {"checked": check.positions, "gap": round(check.gap, 6)}
    if check.nonfinite:
        fields["nonfinite"] = check.nonfinite
    if check.recaptured:
        fields["recapture"] = True
    return fields


def result_entry(result: Any, sha256: str) -> dict[str, Any]:
    return {"sha256": sha256, "samples": result.written + result.skipped_done,
            "written": result.written, "skipped_done": result.skipped_done,
            "skipped_overlong": result.skipped_overlong, "truncated": result.truncated,
            "failed": len(result.failures), "tokens": result.tokens, "bytes": result.bytes,
            "seconds": round(result.seconds, 3), "overlong_ids": result.overlong_ids[:20],
            "state_check": result.check.as_dict(),
            "worker": worker_id(), "time": time.time()}


def _reporter(xl: ExtractionLedger, shard: str, me: str) -> Any:
    def report(handled: int, total: int) -> None:
        try:
            xl.progress(shard, handled, total, me)
        except Exception as exc:  # noqa: BLE001 - progress is for display; the run goes on
            log.warning("progress of %s not recorded: %s", shard, exc)
    return report


def run(settings: Settings, xl: ExtractionLedger, extractor: Callable[[], Any],
        shard: str) -> dict[str, Any]:
    """Run one shard and persist its outcome; ``extractor()`` gives the process's Extractor."""
    me = worker_id()
    if Path(shard).is_absolute() or ".." in Path(shard).parts:
        raise BadInput(f"shard {shard!r} is not a path inside the output folder")
    path = Path(settings.output_dir) / shard
    sha = done_version(file_sha256(path), settings)
    if settings.states_to == "stream":
        require_epoch(xl.r, settings.stream_epoch)
    if xl.is_done(shard, sha):
        xl.settle(shard)  # a late copy of its message: its entry must not send it again
        return {"status": "done before"}
    with xl.lease(shard, me, settings.lease_s) as held:
        if not held:
            return {"status": "busy"}  # a live worker runs it; this message is a duplicate
        if xl.is_done(shard, sha):  # finished between the check and the lease
            return {"status": "done before"}
        log.info("shard %s taken by %s", shard, me)
        result = extractor().run_shard(path, progress=_reporter(xl, shard, me))
        now = time.time()
        dead_letter(settings, [{"kind": "sample", "shard": shard, "idx": f.idx, "id": f.id,
                                "reason": f.reason, "worker": me, "time": now,
                                **check_fields(f.check)}
                               for f in result.failures])
        entry = result_entry(result, sha)
        xl.mark_done(shard, entry, len(result.failures))
    return {"status": "done", **entry}


def give_up(settings: Settings, xl: ExtractionLedger, shard: str,
            exc: BaseException) -> dict[str, Any]:
    reason = f"{type(exc).__name__}: {exc}"
    log.error("shard %s dead-lettered: %s", shard, reason)
    path = Path(settings.output_dir) / shard
    readable = not isinstance(exc, BadInput) and path.is_file()
    sha = file_sha256(path) if readable else ""
    dead_letter(settings, [{"kind": "shard", "shard": shard, "idx": None, "id": None,
                            "reason": reason, "worker": worker_id(), "time": time.time()}])
    xl.mark_dead(shard, sha, reason, worker_id())
    return {"status": "dead", "reason": reason}


def fail(settings: Settings, xl: ExtractionLedger, shard: str,
         exc: BaseException) -> dict[str, Any]:
    """A whole-shard failure: retried after extract_retry_countdown_s by the reaper (no
    Celery countdown: its ETA message would wait in `unacked` if this worker died), then
    dead-lettered after extract_max_retries retries."""
    tries = xl.retry_later(shard, settings.extract_retry_countdown_s)
    log.error("shard %s failed (try %d): %s: %s", shard, tries, type(exc).__name__, exc,
              exc_info=exc)
    if tries > settings.extract_max_retries:
        return give_up(settings, xl, shard, exc)
    return {"status": "retry", "tries": tries}


def reap(settings: Settings, xl: ExtractionLedger, send: Send) -> int:
    """Re-enqueue taken shards whose run died, whose retry delay is over, or whose message
    was taken by a worker that died before the run; dead-letter those that died more often
    than extract_max_retries. One reaper at a time over all workers."""
    me = worker_id()
    if not xl.r.set(keys.EXTRACT_REAPER_LOCK, me, nx=True, px=1000):
        return 0
    count = 0
    for c in xl.reclaimable(EXTRACT_TASK, settings.lease_s):
        if c.tries > settings.extract_max_retries:
            give_up(settings, xl, c.shard, RuntimeError(
                f"{c.tries} runs ended without a result, the last on {c.dead_owner or '?'}"))
            continue
        if c.dead_owner:
            log.warning("shard %s: its run on %s died (lease expired); re-enqueued by %s "
                        "ahead of fresh shards (try %d)", c.shard, c.dead_owner, me, c.tries + 1)
        elif c.lost:
            log.warning("shard %s: sent over %.0fs ago, neither queued nor running (its "
                        "message was taken by a worker that died before the run); "
                        "re-enqueued by %s", c.shard, settings.lease_s, me)
        xl.requeued(c.shard, c.tries, me)
        send(c.shard, True)
        count += 1
    return count
