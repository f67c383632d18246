"""The steps of one generation job: check → call → persist → commit.

The Celery task in ``workers/generate.py`` strings these together; each step is
a function here so tests and benchmarks can drive them without Celery.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from config.settings import Settings
from datagen.client import UNRESOLVED_GRACE_LEASES, Generation, SGLangClient, backoff_s, new_rid
from datagen.errors import (
    BadInput,
    BadRequest,
    CaptureFailed,
    LedgerUnavailable,
    ServerUnavailable,
    StatesNotShared,
    StorageError,
)
from datagen.generation.job import Job, Prompt, read_prompt
from datagen.generation.lease import Lease, LeaseBook
from datagen.generation.ledger import REDIS_AWAY, Admission, Commit, Ledger, owner_id
from datagen.generation.records import RECORD_VERSION, RecordWriter, pack_logprobs
from datagen.generation.turns import Stopped, generate_turns
from datagen.generation.window import cut_at_window, row_length, trainable
from datagen.servers import capture

log = logging.getLogger(__name__)

HEALTH_POLL_S = 2.0
LEDGER_WAIT_S = 600.0
LEDGER_POLL_S = 1.0
# Set when the worker is shutting down: no new request starts, in-flight ones are handed back.
STOPPING = threading.Event()
T = TypeVar("T")


@dataclass
class Context:
    """What a worker process holds once: settings, ledger, HTTP client, records, leases."""

    settings: Settings
    ledger: Ledger
    client: SGLangClient
    writer: RecordWriter
    worker_id: str
    leases: LeaseBook
    precise: bool = True
    host: str = field(default_factory=socket.gethostname)  # every record's "host"

    @classmethod
    def create(cls, settings: Settings, worker_id: str | None = None) -> Context:
        client = SGLangClient(settings.server_url, settings.api_key,
                              settings.connect_timeout_s, settings.read_timeout_s,
                              settings.server_kind,
                              unresolved_grace_s=settings.lease_s * UNRESOLVED_GRACE_LEASES)
        owner = worker_id or owner_id(socket.gethostname(), os.getpid())
        ledger = Ledger.from_settings(settings)
        return cls(settings, ledger, client, RecordWriter(settings.output_dir, owner), owner,
                   LeaseBook(ledger, owner), settings.precise_admission)


@dataclass(frozen=True)
class Outcome:
    # stored | duplicate | closed | done | busy | waiting | requeue | lapsing | lapsed |
    # dead | discarded
    status: str
    tokens: int = 0
    closed_now: bool = False
    detail: str = ""
    woken: tuple[str, ...] = ()  # payloads of parked samples to enqueue again


def sampling_params(settings: Settings, job: Job) -> dict[str, Any]:
    params = dict(settings.sampling_params)
    params["max_new_tokens"] = job.max_new_tokens
    return params


def admit(ctx: Context, job: Job, rid: str) -> Admission:
    """Ask the ledger for room; a refused sample is parked by the ledger itself. While the
    ledger is away or being rebuilt (no run marker), wait for it."""
    def attempt() -> Admission:
        adm = ctx.ledger.admit(job.dataset, job.sample, rid, ctx.worker_id, job.prompt_tokens,
                               counted_cap(ctx.settings, job), precise=ctx.precise,
                               server=ctx.client.base_url)
        if adm.status == "lost":
            raise LedgerUnavailable("the ledger lost its state (no run marker); admission "
                                    "waits for it to be rebuilt from the records")
        return adm
    return _until_ledger(attempt, f"admission of {job.dataset}/{job.sample}")


def counted_cap(settings: Settings, job: Job) -> int:
    """The most the sample can count against its budget: its cap, and with budget_counts
    "trainable" no more than the window leaves after its prompt (what admission reserves)."""
    if settings.budget_counts != "trainable":
        return job.sample_cap
    return min(job.sample_cap, max(1, settings.train_max_length - job.prompt_tokens))


def trained_tokens(settings: Settings, prompt: Prompt, gen: Generation,
                   turns: list[dict[str, Any]] | None = None) -> int:
    """What SpecForge trains of the sample's row (``window.trainable``)."""
    n_prompt = len(prompt.prompt_ids)
    spans = [t["span"] for t in turns] if turns else ()
    captured = settings.capture_states and settings.extract_backend == "captured"
    return trainable(n_prompt, row_length(n_prompt, len(gen.output_ids), captured),
                     settings.train_max_length, settings.extract_overlong, spans)


def call(ctx: Context, job: Job, prompt: Prompt, rid: str,
         states: Path | None = None) -> Generation:
    extra = ({"kv_transfer_params": capture.request_params(states,
                                                          ctx.settings.train_max_length)}
             if states else None)
    return ctx.client.generate(prompt.prompt_ids, sampling_params(ctx.settings, job), rid,
                               dataset=job.dataset, extra=extra,
                               logprobs=ctx.settings.check_states,
                               prompt_logprobs=ctx.settings.check_prompt_states)


def await_states(settings: Settings, path: Path, prompt: Prompt, gen: Generation
                 ) -> dict[str, Any]:
    """Wait for the server's file of this attempt and check it against the ids this worker
    holds (prompt + output, the last output id excepted: never an input), up to the window
    (train_max_length: the connector writes no position past it). What the record
    says of it; CaptureFailed (retryable: the sample runs again) when it does not come whole
    within ``capture_timeout_s`` or is not this sample's."""
    if not capture.wait_released(path, settings.capture_timeout_s):
        raise CaptureFailed(f"{path.name} still locked by the server after "
                            f"{settings.capture_timeout_s:.0f} s (capture_timeout_s)")
    try:
        ids = (prompt.prompt_ids + gen.output_ids[:-1])[:settings.train_max_length]
        size = capture.check_file(path, ids,
                                  _aux_layer_ids(tuple(settings.aux_layer_ids or ()),
                                                 settings.model_path))
    except (capture.CaptureMismatch, OSError) as exc:
        if not path.exists():
            UNSEEN.check(path, settings.capture_unseen_limit, settings.output_dir)
        raise CaptureFailed(f"captured states: {exc}") from exc
    UNSEEN.reset()
    Path(f"{path}.lock").unlink(missing_ok=True)
    return {"states": str(path.relative_to(Path(settings.output_dir).resolve())),
            "states_bytes": size}


UNSEEN = capture.Unseen()  # this process's files found neither written nor locked, in a row


@functools.lru_cache(maxsize=4)
def _aux_layer_ids(aux: tuple[int, ...], model_path: str) -> list[int] | None:
    return capture.run_aux_layer_ids(aux, model_path)


def persist(ctx: Context, job: Job, prompt: Prompt, rid: str, gen: Generation, trained: int,
            extra: dict[str, Any] | None = None) -> None:
    """Store the record; ``trained``: its ``trained_tokens``, which the commit counts too."""
    ctx.writer.append({
        "v": RECORD_VERSION, "id": job.sample, "dataset": job.dataset, "rid": rid,
        "queue": job.queue, "messages": prompt.messages, "prompt_ids": prompt.prompt_ids,
        "output_ids": gen.output_ids, "finish_reason": gen.finish_reason,
        "prompt_tokens": gen.prompt_tokens or len(prompt.prompt_ids),
        "completion_tokens": gen.completion_tokens, "truncated": gen.truncated,
        "trainable_tokens": trained,
        "server": ctx.client.base_url, "worker": ctx.worker_id,
        "host": ctx.host, "time": time.time(), "latency_s": gen.latency_s,
        **({"tools": prompt.tools} if prompt.tools else {}),
        # the server's log-probability of each output id (check_states, vLLM): extraction
        # checks the sample's final states against them
        **({"output_logprobs": pack_logprobs(gen.logprobs)} if gen.logprobs else {}),
        # the same of prompt id j + 1 (check_prompt_states): the prompt's positions checked
        **({"prompt_logprobs": pack_logprobs(gen.prompt_logprobs)}
           if gen.prompt_logprobs else {}),
        **(extra or {}),  # "turns" of a multi-turn sample
    })


def commit(ctx: Context, job: Job, prompt: Prompt, lease: Lease, gen: Generation,
           trained: int) -> Outcome:
    """Count the stored record (``trained``: its trainable tokens, as stored). While Redis
    is away, or has lost its state and is not yet rebuilt, keep trying: the record is safe
    on disk, and counted once either way."""
    def attempt() -> Commit:
        result = lease.commit(gen.prompt_tokens or len(prompt.prompt_ids),
                              gen.completion_tokens, gen.truncated, gen.latency_s,
                              ctx.client.base_url, held=ctx.settings.capture_states,
                              trainable_tokens=trained)
        if result.lost:
            raise LedgerUnavailable("the ledger lost its state (no run marker); the commit "
                                    "waits for it to be rebuilt from the records")
        return result
    result = _until_ledger(attempt, f"commit of {job.dataset}/{job.sample}")
    if result.lapsed:
        # its lease lapsed or was reaped (the sample runs again elsewhere) and prepare may
        # have pruned its states since: the record stays on disk, never counted
        log.warning("sample %s of %s: stored after its lease ended; not counted (it runs "
                    "again)", job.sample, job.dataset)
        return Outcome("lapsed", detail="lease ended before the commit")
    status = "stored" if result.committed else "duplicate"
    return Outcome(status, gen.completion_tokens, result.closed_now)


def run_job(ctx: Context, job: Job) -> Outcome:
    """Check, call, persist, commit — with retries on a failing server.

    A try counts against ``max_retries`` only when the server looked healthy: while
    it is down the job waits for it instead of burning its retries. The sample is claimed
    for the whole task (``LeaseBook.running``): another copy of it in this process waits,
    then finds it done (or runs it, if this one did not store it).
    """
    with ctx.leases.running(job.dataset, job.sample) as waited:
        if waited:
            log.info("sample %s of %s: another copy of it ran here first", job.sample,
                     job.dataset)
        return _run_job(ctx, job)


def _run_job(ctx: Context, job: Job) -> Outcome:
    settings = ctx.settings
    attempt = 0
    woken: list[str] = []
    while True:
        if STOPPING.is_set():
            return Outcome("requeue", detail="worker stopping", woken=tuple(woken))
        rid = new_rid(job.dataset)
        adm = admit(ctx, job, rid)
        if adm.status == "wait":
            return Outcome("waiting", woken=tuple(woken))
        if adm.status != "ok":
            return Outcome(adm.status, closed_now=adm.closed_now, woken=tuple(woken))
        lease = ctx.leases.hold(job.dataset, job.sample, rid)
        cut_off = False
        try:
            with lease:
                try:
                    if ctx.leases.server_lost.is_set():
                        # the heartbeat lost the server after this task was taken (it stops
                        # taking more): the sample goes back to the queue for a worker that
                        # reaches its server, not as a request that could arrive after the
                        # heal beside the reaper's re-run
                        outcome = Outcome("requeue", detail="server lost from here")
                    else:
                        outcome = _generate_admitted(ctx, job, lease)
                except ServerUnavailable:
                    # a lease the heartbeat ended (the server lost) is a reaper's to re-run,
                    # however the server answers now: a retry here would run it twice
                    cut_off = ctx.leases.lapsed(rid) or not ctx.client.reachable()
                    if cut_off:
                        lease.abandon()
                    raise
        except ServerUnavailable as exc:
            woken += lease.woken
            if cut_off:
                # This worker is cut off from its server (others may not be): its request
                # may still run there, so the lease is ended, not released; a worker that
                # reaches the server then aborts the rid and re-runs the sample. Nothing
                # waits here.
                log.warning("sample %s of %s: the server cannot be reached from here (%s); "
                            "its lease ended for a worker that reaches it", job.sample,
                            job.dataset, exc)
                return Outcome("lapsing", detail="server unreachable", woken=tuple(woken))
            if attempt >= settings.max_retries:
                return _dead(ctx, job, f"server unavailable after {attempt + 1} tries: {exc}",
                             woken)
            log.warning("sample %s of %s: %s (try %d)", job.sample, job.dataset, exc, attempt + 1)
            if wait_for_server(ctx, job):
                attempt += 1
                time.sleep(backoff_s(attempt, settings.retry_backoff_s))
            continue
        except (BadRequest, BadInput, StatesNotShared) as exc:
            return _dead(ctx, job, str(exc), woken + lease.woken)
        return replace(outcome, woken=tuple(woken + lease.woken))


def _generate_admitted(ctx: Context, job: Job, lease: Lease) -> Outcome:
    prompt = read_prompt(ctx.settings.output_dir, job)
    if job.turns > 1:
        return _generate_conversation(ctx, job, prompt, lease)
    states = (capture.states_path(ctx.settings.output_dir, job.dataset, lease.rid)
              if ctx.settings.capture_states else None)
    recorded = False
    try:
        gen = call(ctx, job, prompt, lease.rid, states)
        if gen.aborted:
            # Aborted because the dataset closed (abort policy) or this worker is stopping:
            # the partial output is discarded, never stored (the lease is released on exit).
            ctx.ledger.count(job.dataset, "discarded_tokens", gen.completion_tokens)
            if STOPPING.is_set() and not ctx.ledger.closed(job.dataset):
                return Outcome("requeue", detail="handed back on shutdown")
            return Outcome("discarded", gen.completion_tokens)
        if gen.truncated and not ctx.settings.keep_truncated and not cut_at_window(
                len(prompt.prompt_ids) + len(gen.output_ids), ctx.settings.train_max_length):
            return _dead(ctx, job, "truncated at max_new_tokens inside train_max_length and "
                                   "keep_truncated is off")
        # with capture on, a sample is never counted without its states: its record names them
        extra = await_states(ctx.settings, states, prompt, gen) if states else None
        trained = trained_tokens(ctx.settings, prompt, gen)
        try:
            persist(ctx, job, prompt, lease.rid, gen, trained, extra)
        except StorageError as exc:
            log.error("sample %s of %s not stored: %s", job.sample, job.dataset, exc)
            raise
        recorded = True
    finally:
        if states and not recorded:  # no record will ever name this attempt's file
            capture.remove(states)
    return commit(ctx, job, prompt, lease, gen, trained)


def _generate_conversation(ctx: Context, job: Job, prompt: Prompt, lease: Lease) -> Outcome:
    """regenerate = "all": every turn, then one record and one commit for the sample."""
    def may_continue() -> str:
        if STOPPING.is_set():
            return "stopping"
        return _until_ledger(lambda: ctx.ledger.may_continue(job.dataset, job.sample,
                                                             lease.rid),
                             f"next turn of {job.dataset}/{job.sample}")
    result = generate_turns(ctx.client, job, prompt, lease.rid, sampling_params(ctx.settings, job),
                            ctx.settings.keep_truncated, may_continue)
    if isinstance(result, Stopped):
        return _stopped(ctx, job, result)
    gen = result.as_generation()
    whole = replace(prompt, prompt_ids=result.prompt_ids, turn_ids=[])
    trained = trained_tokens(ctx.settings, whole, gen, result.turns)
    persist(ctx, job, whole, lease.rid, gen, trained, {"turns": result.turns})
    return commit(ctx, job, whole, lease, gen, trained)


def _stopped(ctx: Context, job: Job, stop: Stopped) -> Outcome:
    """A sample cut before its last turn: nothing is stored or counted but the waste."""
    if stop.reason in ("context", "truncated"):
        return _dead(ctx, job, stop.detail)
    ctx.ledger.count(job.dataset, "discarded_tokens", stop.tokens)
    log.info("sample %s of %s: %s", job.sample, job.dataset, stop.detail)
    if stop.reason == "stopping" or (stop.reason == "aborted" and STOPPING.is_set()
                                     and not ctx.ledger.closed(job.dataset)):
        return Outcome("requeue", detail="handed back on shutdown")
    if stop.reason == "lost":
        return Outcome("busy", detail=stop.detail)
    return Outcome("discarded", stop.tokens, detail=stop.detail)


def _dead(ctx: Context, job: Job, reason: str, woken: list[str] | None = None) -> Outcome:
    log.error("sample %s of %s dead-lettered: %s", job.sample, job.dataset, reason)
    _until_ledger(lambda: ctx.ledger.dead_letter(job.dataset, job.sample, reason),
                  f"dead letter of {job.sample}")
    return Outcome("dead", detail=reason, woken=tuple(woken or ()))


def _until_ledger(step: Callable[[], T], what: str) -> T:
    """Run a ledger step, waiting out Redis outages (up to LEDGER_WAIT_S)."""
    deadline = time.monotonic() + LEDGER_WAIT_S
    warned = False
    while True:
        try:
            return step()
        except (LedgerUnavailable, *REDIS_AWAY) as exc:
            if time.monotonic() > deadline:
                raise
            if not warned:
                log.warning("%s waits for the ledger: %s", what, exc)
                warned = True
            time.sleep(LEDGER_POLL_S)


def wait_for_server(ctx: Context, job: Job, max_wait_s: float = 3600.0) -> bool:
    """Wait while the server is unhealthy; True when it was healthy all along. The wait
    ends too when the heartbeat loses the server (the caller then hands the sample back)."""
    if ctx.client.healthy():
        return True
    log.warning("server %s unhealthy: waiting for it", ctx.client)
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline and not STOPPING.is_set():
        if _closed(ctx, job) or ctx.client.healthy():
            break
        if ctx.leases.server_lost.wait(HEALTH_POLL_S):
            break
    return False


def _closed(ctx: Context, job: Job) -> bool:
    try:
        return bool(ctx.ledger.closed(job.dataset))
    except Exception:  # Redis away too: keep waiting for the server; admission decides later
        return False
