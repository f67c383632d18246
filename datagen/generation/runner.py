"""The steps of one generation job: check → call → persist → commit.

The Celery task in ``workers/generate.py`` strings these together; each step is
a function here so tests and benchmarks can drive them without Celery.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from config.settings import Settings
from datagen.client import Generation, SGLangClient, backoff_s, new_rid
from datagen.errors import BadInput, BadRequest, LedgerUnavailable, ServerUnavailable, StorageError
from datagen.generation.job import Job, Prompt, read_prompt
from datagen.generation.ledger import Admission, Ledger
from datagen.generation.records import RECORD_VERSION, RecordWriter
from datagen.metrics import record_request

log = logging.getLogger(__name__)

ADMISSION_WAIT_S = 2.0
HEALTH_POLL_S = 2.0
LEDGER_WAIT_S = 600.0
# Set when the worker is shutting down: no new request starts, in-flight ones are handed back.
STOPPING = threading.Event()


@dataclass
class Context:
    """What a worker process holds once: settings, ledger, HTTP client, record writer."""

    settings: Settings
    ledger: Ledger
    client: SGLangClient
    writer: RecordWriter
    worker_id: str
    precise: bool = True

    @classmethod
    def create(cls, settings: Settings, worker_id: str | None = None) -> Context:
        client = SGLangClient(settings.server_url, settings.api_key,
                              settings.connect_timeout_s, settings.read_timeout_s)
        writer = RecordWriter(settings.output_dir)
        return cls(settings, Ledger.from_settings(settings), client, writer,
                   worker_id or writer.writer_id, settings.precise_admission)


@dataclass(frozen=True)
class Outcome:
    status: str  # stored | duplicate | closed | done | busy | requeue | dead | discarded
    tokens: int = 0
    closed_now: bool = False
    detail: str = ""


def sampling_params(settings: Settings, job: Job) -> dict[str, Any]:
    params = dict(settings.sampling_params)
    params["max_new_tokens"] = job.max_new_tokens
    return params


def admit(ctx: Context, job: Job, rid: str, wait_s: float = ADMISSION_WAIT_S) -> Admission:
    """Ask the ledger for room; wait briefly while the budget has none yet."""
    deadline = time.monotonic() + wait_s
    while True:
        adm = ctx.ledger.admit(job.dataset, job.sample, rid, ctx.worker_id, job.prompt_tokens,
                               job.max_new_tokens, precise=ctx.precise,
                               server=ctx.client.base_url)
        if adm.status != "wait" or time.monotonic() >= deadline:
            return adm
        time.sleep(0.2)


def call(ctx: Context, job: Job, prompt: Prompt, rid: str) -> Generation:
    return ctx.client.generate(prompt.prompt_ids, sampling_params(ctx.settings, job), rid,
                               dataset=job.dataset)


def persist(ctx: Context, job: Job, prompt: Prompt, rid: str, gen: Generation) -> None:
    ctx.writer.append({
        "v": RECORD_VERSION, "id": job.sample, "dataset": job.dataset, "rid": rid,
        "queue": job.queue, "messages": prompt.messages, "prompt_ids": prompt.prompt_ids,
        "output_ids": gen.output_ids, "finish_reason": gen.finish_reason,
        "prompt_tokens": gen.prompt_tokens or len(prompt.prompt_ids),
        "completion_tokens": gen.completion_tokens, "truncated": gen.truncated,
        "server": ctx.client.base_url, "worker": ctx.worker_id,
        "host": socket.gethostname(), "time": time.time(), "latency_s": gen.latency_s,
    })


def commit(ctx: Context, job: Job, prompt: Prompt, rid: str, gen: Generation) -> Outcome:
    """Count the stored record; while Redis is away, keep trying (the record is safe on disk)."""
    deadline = time.monotonic() + LEDGER_WAIT_S
    while True:
        try:
            result = ctx.ledger.commit(job.dataset, job.sample, rid,
                                       gen.prompt_tokens or len(prompt.prompt_ids),
                                       gen.completion_tokens, gen.truncated, gen.latency_s)
            break
        except LedgerUnavailable as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("commit of %s/%s waits for Redis: %s", job.dataset, job.sample, exc)
            time.sleep(1.0)
    if result.committed:
        record_request(ctx.ledger.r, ctx.client.base_url, gen.latency_s, gen.completion_tokens)
    status = "stored" if result.committed else "duplicate"
    return Outcome(status, gen.completion_tokens, result.closed_now)


def run_job(ctx: Context, job: Job) -> Outcome:
    """Check, call, persist, commit — with retries on a failing server.

    A try counts against ``max_retries`` only when the server looked healthy: while
    it is down the job waits for it instead of burning its retries.
    """
    settings = ctx.settings
    attempt = 0
    while True:
        if STOPPING.is_set():
            return Outcome("requeue", detail="worker stopping")
        rid = new_rid()
        adm = admit(ctx, job, rid)
        if adm.status == "wait":
            ctx.ledger.count(job.dataset, "refused")
            return Outcome("requeue")
        if adm.status != "ok":
            return Outcome(adm.status)
        try:
            return _generate_admitted(ctx, job, rid)
        except ServerUnavailable as exc:
            ctx.ledger.release(job.dataset, job.sample, rid)
            if attempt >= settings.max_retries:
                return _dead(ctx, job, f"server unavailable after {attempt + 1} tries: {exc}")
            log.warning("sample %s of %s: %s (try %d)", job.sample, job.dataset, exc, attempt + 1)
            if wait_for_server(ctx, job):
                attempt += 1
                time.sleep(backoff_s(attempt, settings.retry_backoff_s))
        except (BadRequest, BadInput) as exc:
            ctx.ledger.release(job.dataset, job.sample, rid)
            return _dead(ctx, job, str(exc))
        except BaseException:
            ctx.ledger.release(job.dataset, job.sample, rid)
            raise


def _generate_admitted(ctx: Context, job: Job, rid: str) -> Outcome:
    prompt = read_prompt(ctx.settings.output_dir, job)
    gen = call(ctx, job, prompt, rid)
    if gen.aborted:
        # Aborted because the dataset closed (abort policy) or this worker is stopping:
        # the partial output is discarded, never stored.
        ctx.ledger.release(job.dataset, job.sample, rid)
        ctx.ledger.count(job.dataset, "discarded_tokens", gen.completion_tokens)
        if STOPPING.is_set() and not ctx.ledger.closed(job.dataset):
            return Outcome("requeue", detail="handed back on shutdown")
        return Outcome("discarded", gen.completion_tokens)
    if gen.truncated and not ctx.settings.keep_truncated:
        ctx.ledger.release(job.dataset, job.sample, rid)
        return _dead(ctx, job, "truncated at max_new_tokens and keep_truncated is off")
    try:
        persist(ctx, job, prompt, rid, gen)
    except StorageError as exc:
        ctx.ledger.release(job.dataset, job.sample, rid)
        log.error("sample %s of %s not stored: %s", job.sample, job.dataset, exc)
        raise
    return commit(ctx, job, prompt, rid, gen)


def _dead(ctx: Context, job: Job, reason: str) -> Outcome:
    log.error("sample %s of %s dead-lettered: %s", job.sample, job.dataset, reason)
    ctx.ledger.dead_letter(job.dataset, job.sample, reason)
    ctx.ledger.count(job.dataset, "dead")
    return Outcome("dead", detail=reason)


def wait_for_server(ctx: Context, job: Job, max_wait_s: float = 3600.0) -> bool:
    """Wait while the server is unhealthy; True when it was healthy all along."""
    if ctx.client.healthy():
        return True
    log.warning("server %s unhealthy: waiting for it", ctx.client)
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline and not STOPPING.is_set():
        if ctx.ledger.closed(job.dataset) or ctx.client.healthy():
            break
        time.sleep(HEALTH_POLL_S)
    return False
