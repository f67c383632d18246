"""The producer: read datasets, tokenize with the chat template, enqueue what is missing.

It enqueues by task name (``datagen.generation.guard.enqueue`` → ``send_task``) and never
imports worker code. Running it again enqueues only samples that are neither
done nor already waiting in a queue.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from celery import Celery

from config.settings import Settings, SettingsError, masked_url
from datagen import keys
from datagen.client import INPUT_RESERVE, Limits, SGLangClient
from datagen.errors import ServerUnavailable
from datagen.generation.guard import close, enqueue
from datagen.generation.job import Job, PromptStore
from datagen.generation.ledger import Ledger
from datagen.generation.merge import datasets_on_disk
from datagen.generation.recovery import needs_rebuild, rebuild_dataset
from datagen.generation.window import cap_share, room
from datagen.operations.progress import Progress
from datagen.tokenization.chat import ChatEncoder, ChatTemplateError, HistoryRewritten
from producers.files import count_rows, dataset_files
from producers.reader import BadRecord, Prompt, discover_datasets, read_dataset

log = logging.getLogger(__name__)

BATCH = 256
REBUILD_LOCK_S = 600
REPORTS_DIR = "reports"
# A prompt's first prompt ids, and the template's ids before each later assistant turn.
Encoded = tuple[list[int], list[list[int]]]
# The chat regenerate = "all" is tried on before a run: how a template writes an earlier turn
# back does not depend on the words.
TWO_TURNS = ({"role": "user", "content": "First question?"},
             {"role": "assistant", "content": "First answer."},
             {"role": "user", "content": "Second question?"})


@dataclass
class DatasetReport:
    dataset: str
    read: int = 0
    conversations: int = 0  # regenerate = "each": the lines its samples came from
    enqueued: int = 0
    already_done: int = 0
    already_queued: int = 0
    over_cap: int = 0
    short: int = 0
    long: int = 0
    clamped: int = 0
    skipped: str = ""  # why the whole dataset was skipped
    rebuilt: str = ""  # what was adopted from records on disk
    bad: list[str] = field(default_factory=list)
    window: list[str] = field(default_factory=list)  # prompts the window leaves no room
    cap_tokens: int = 0  # the max_new_tokens of the samples enqueued, summed
    cap_trains: int = 0  # of those, the tokens inside train_max_length
    # enqueued with cap_to_window off: prompts train_max_length leaves nothing to train (prepare
    # will drop them), and prompts whose cap reaches past it (prepare may cut them)
    window_drop: int = 0
    window_cut: int = 0

    @property
    def bad_count(self) -> int:
        return len(self.bad)

    @property
    def trains(self) -> float | None:
        """The share of the enqueued caps that can train (None: nothing enqueued)."""
        return self.cap_trains / self.cap_tokens if self.cap_tokens else None


@dataclass(frozen=True)
class Plan:
    queue: str
    max_new_tokens: int


def classify(settings: Settings, prompt_tokens: int, limits: Limits | None) -> Plan | str:
    """The queue and max_new_tokens for a prompt, or the reason the server would refuse it.

    SGLang 0.5.23 refuses an input of max_req_input_len tokens or more, and a request whose
    prompt + max_new_tokens exceeds its context length; max_new_tokens is clamped to one
    less than that (``Limits.room``).
    """
    queue = "short" if prompt_tokens <= settings.long_threshold_tokens else "long"
    _, max_new = settings.queue_limits(queue)
    if limits is not None:
        refusal = limits.refusal(prompt_tokens)
        if refusal:
            return refusal
        max_new = min(max_new, limits.room(prompt_tokens))
    return Plan(queue, max_new)


def fit_window(settings: Settings, plan: Plan, fixed: int, turns: int) -> Plan | str:
    """With cap_to_window, the plan's max_new_tokens capped at what train_max_length leaves
    after the row's ``fixed`` ids (the prompt, and the template's ids between turns), or why
    the prompt is not sent: it leaves fewer than min_trainable_tokens (or a turn nothing)."""
    if not settings.cap_to_window:
        return plan
    window = settings.train_max_length
    left = room(fixed, window)
    if left < max(settings.min_trainable_tokens, turns):
        return (f"the window: the prompt ({fixed} tokens) leaves {left} of train_max_length "
                f"{window} to generate, fewer than min_trainable_tokens "
                f"{settings.min_trainable_tokens}; not sent")
    return replace(plan, max_new_tokens=min(plan.max_new_tokens, left))


def server_limits(settings: Settings) -> Limits:
    """The context length and longest input in force: the server's own (``SGLangClient.
    limits``), or the ``context_length`` setting, which may lower the server's but never
    raise it. Without either, clamped prompts would be refused, so nothing is enqueued."""
    client = SGLangClient(settings.server_url, settings.api_key, 5.0, 30.0,
                          settings.server_kind)
    where = masked_url(settings.server_url)
    try:
        found = client.limits()
    except ServerUnavailable as exc:
        if settings.context_length:
            log.warning("context_length %d is not checked against the server (%s)",
                        settings.context_length, exc)
            return Limits(settings.context_length,
                          settings.context_length - INPUT_RESERVE, "the context_length setting")
        raise ServerUnavailable(
            f"context length unknown ({exc}): start the server at server_url or set "
            "context_length, so max_new_tokens fits every prompt; nothing enqueued") from exc
    if settings.context_length is None:
        log.info("context length %d, inputs under %d tokens (%s)", found.context_length,
                 found.max_input_tokens, found.source)
        return found
    if settings.context_length > found.context_length:
        raise SettingsError(
            f"context_length: the setting {settings.context_length} is larger than the "
            f"server's context length {found.context_length} ({found.source} at {where}): "
            "the server would refuse the requests sized to it; lower or unset it; "
            "nothing enqueued")
    return Limits(settings.context_length,
                  min(found.max_input_tokens, settings.context_length - INPUT_RESERVE),
                  "the context_length setting")


def refuse_rewritten_history(settings: Settings, encoder: ChatEncoder) -> None:
    """regenerate = "all" refused up front, nothing enqueued, for a template that rewrites
    earlier assistant turns (``ChatEncoder.encode_turns``): every line would be refused."""
    try:
        encoder.encode_turns(TWO_TURNS)
    except HistoryRewritten as exc:
        raise SettingsError(f"regenerate: {exc} (the chat template of tokenizer_path "
                            f"{settings.tokenizer_path}); nothing enqueued") from exc
    except ChatTemplateError:
        pass  # the template refuses this chat itself: each line's own check says why


def rendering_kind(settings: Settings) -> str:
    """Whose rendering of a chat request the prompts follow: ``server_kind``, or with
    "auto" the kind the server at server_url says it is (asked once)."""
    if settings.server_kind != "auto":
        return settings.server_kind
    client = SGLangClient(settings.server_url, settings.api_key, 5.0, 30.0, "auto")
    try:
        return client.kind.name
    except ServerUnavailable as exc:
        raise ServerUnavailable(
            f"server_kind 'auto': {exc}; prompts are rendered as that server renders a chat "
            "request, so its kind must be known: start it or set server_kind; nothing "
            "enqueued") from exc


class Producer:
    def __init__(self, settings: Settings, app: Celery, ledger: Ledger):
        self.settings = settings
        self.app = app
        self.ledger = ledger
        self.encoder = ChatEncoder(settings.tokenizer_path, settings.chat_template_kwargs,
                                   settings.trust_remote_code, rendering_kind(settings))
        if settings.regenerate == "all":
            refuse_rewritten_history(settings, self.encoder)
        self.limits = server_limits(settings)

    def run(self) -> list[DatasetReport]:
        datasets = discover_datasets(Path(self.settings.data_dir), self.settings.partition)
        self.ledger.register(name for name, _ in datasets)
        reports = {name: DatasetReport(name) for name, _ in datasets}
        self.rebuild(reports)
        produced = [self.produce(name, path, reports.pop(name)) for name, path in datasets]
        return produced + list(reports.values())  # rebuilt, though not in this partition

    def rebuild(self, reports: dict[str, DatasetReport]) -> None:
        """Rebuild from the records on disk what the ledger does not hold, then mark the run.

        Without the run marker (a first run, or Redis lost its data) every dataset on disk
        is rebuilt, while workers hold their commits; the marker then lets them go on. One
        process rebuilds at a time (a follower and `datagen recover` may both try).
        """
        if self.ledger.run_marker() is None:
            with self.ledger.r.lock(keys.REBUILD_LOCK, timeout=REBUILD_LOCK_S):
                if self.ledger.run_marker() is None:
                    on_disk = datasets_on_disk(self.settings.output_dir)
                    self._rebuild(reports, on_disk)
                    self.ledger.mark_run()
        self._rebuild(reports, [d for d in reports if needs_rebuild(self.ledger, d)])

    def _rebuild(self, reports: dict[str, DatasetReport], datasets: list[str]) -> None:
        for dataset in datasets:
            self.ledger.register([dataset])
            rebuilt = rebuild_dataset(self.ledger, dataset)
            line = rebuilt.line(self.ledger.budget(dataset))
            reports.setdefault(dataset, DatasetReport(dataset)).rebuilt = line
            log.info("rebuilt from records on disk: %s", line)

    def produce(self, dataset: str, path: Path, report: DatasetReport | None = None
                ) -> DatasetReport:
        report = report or DatasetReport(dataset)
        reason = self.skip_reason(dataset)
        if reason:
            report.skipped = reason
            log.info("%s", reason)
            return report
        done = self.ledger.done_ids(dataset)
        queued = self.ledger.pending_ids(dataset)
        cap = self._room(dataset, len(done))
        store = PromptStore(self.settings.output_dir, dataset)
        epoch = self.ledger.epoch(dataset)
        started = time.monotonic()
        progress = Progress(f"produce {dataset}", count_rows(dataset_files(path)), "prompts")
        try:
            # One Redis pipeline per batch of messages (kombu 5.7's Producer.batch), not
            # one round trip and one client object per message.
            batches = _batches(self._samples(read_dataset(dataset, path), report), BATCH)
            with self.app.producer_or_acquire() as producer, producer.batch(BATCH), \
                    _sent_events(self.app, self.settings.bulk_sent_events):
                for fresh, ids_list, lines in self._tokenized(batches, report, done, queued):
                    jobs = self._prepare(fresh, ids_list, report, store, epoch, cap)
                    store.flush()
                    self._send(dataset, jobs, producer)
                    report.enqueued += len(jobs)
                    progress.update(lines)
                    if cap is not None:
                        cap -= len(jobs)
        finally:
            store.close()
            progress.close()
        self._write_bad_report(report)
        log.info("%s: %d enqueued (%d short, %d long) in %.1fs; %d done before, %d already "
                 "queued, %d bad, %d left no room in the window", dataset, report.enqueued,
                 report.short, report.long, time.monotonic() - started, report.already_done,
                 report.already_queued, report.bad_count, len(report.window))
        return report

    def skip_reason(self, dataset: str) -> str:
        snap = self.ledger.snapshot(dataset)
        if snap["tokens"] >= snap["budget"]:
            # A budget lowered in the settings: the close acts now (revoke, abort), not at
            # the next admission or commit.
            close(self.app, self.ledger, dataset, "budget", self.settings.abort_on_close)
            return (f"{dataset}: {snap['tokens']:,} tokens >= budget {snap['budget']:,}, "
                    "skipping")
        if snap["closed"]:
            return f"{dataset}: closed ({snap['closed']}), skipping"
        return ""

    def _samples(self, items: Iterable[Prompt | BadRecord], report: DatasetReport
                 ) -> Iterator[Prompt | BadRecord]:
        """The samples of a dataset's lines: with regenerate = "each", one per assistant turn
        of each conversation (``Prompt.events``), else one per line."""
        for item in items:
            if self.settings.regenerate != "each" or isinstance(item, BadRecord):
                yield item
                continue
            report.conversations += 1
            yield from item.events()

    def _room(self, dataset: str, done: int) -> int | None:
        if self.settings.max_samples is None:
            return None
        return max(0, self.settings.max_samples - done)

    def _filter(self, batch: list[Prompt | BadRecord], report: DatasetReport,
                done: set[str], queued: set[str]) -> list[Prompt]:
        fresh = []
        for item in batch:
            if isinstance(item, BadRecord):
                report.bad.append(str(item))
                continue
            report.read += 1
            if item.sample_id in done:
                report.already_done += 1
            elif item.sample_id in queued:
                report.already_queued += 1
            else:
                fresh.append(item)
        return fresh

    def _tokenized(self, batches: Iterator[list[Prompt | BadRecord]], report: DatasetReport,
                   done: set[str], queued: set[str]
                   ) -> Iterator[tuple[list[Prompt], list[Encoded | None], int]]:
        """Fresh prompts, their ids and the lines read, per batch, tokenized one batch ahead
        in a thread: the Rust tokenizer releases the GIL, so it overlaps with publishing."""
        with ThreadPoolExecutor(1, thread_name_prefix="tokenize") as pool:
            ahead: tuple[list[Prompt], Future[list[Encoded | None]], int] | None = None
            for batch in batches:
                fresh = self._filter(batch, report, done, queued)
                future = pool.submit(self._encode, fresh, report)
                if ahead is not None:
                    yield ahead[0], ahead[1].result(), ahead[2]
                ahead = (fresh, future, len(batch))
            if ahead is not None:
                yield ahead[0], ahead[1].result(), ahead[2]

    def _prepare(self, prompts: list[Prompt], ids_list: list[Encoded | None],
                 report: DatasetReport, store: PromptStore, epoch: int, cap: int | None
                 ) -> list[Job]:
        if cap is not None:
            report.over_cap += max(0, len(prompts) - cap)
            prompts, ids_list = prompts[:cap], ids_list[:cap]
        jobs = []
        for prompt, encoded in zip(prompts, ids_list, strict=True):
            if encoded is None:
                continue
            ids, turn_ids = encoded
            plan = classify(self.settings, len(ids), self.limits)
            if isinstance(plan, str):
                report.bad.append(f"{prompt.source}: {plan}")
                continue
            if plan.max_new_tokens < self.settings.queue_limits(plan.queue)[1]:
                report.clamped += 1
            fixed = len(ids) + sum(len(between) for between in turn_ids)
            plan = fit_window(self.settings, plan, fixed, 1 + len(turn_ids))
            if isinstance(plan, str):
                report.window.append(f"{prompt.source}: {plan}")
                continue
            setattr(report, plan.queue, getattr(report, plan.queue) + 1)
            offset = store.add(prompt.sample_id, prompt.dataset, list(prompt.messages), ids,
                               turn_ids, list(prompt.tools) if prompt.tools else None)
            job = Job(prompt.dataset, prompt.sample_id, plan.queue, store.relative,
                      offset, len(ids), plan.max_new_tokens, epoch, turns=1 + len(turn_ids),
                      context_length=self.limits.context_length,
                      max_input_tokens=self.limits.max_input_tokens,
                      window=self.settings.train_max_length if self.settings.cap_to_window
                      else 0)
            jobs.append(job)
            report.cap_tokens += job.sample_cap
            report.cap_trains += cap_share(fixed, job.sample_cap, self.settings.train_max_length)
            report.window_drop += fixed + 1 >= self.settings.train_max_length
            report.window_cut += fixed + 1 < self.settings.train_max_length < \
                fixed + job.sample_cap
        return jobs

    def _encode(self, prompts: list[Prompt], report: DatasetReport) -> list[Encoded | None]:
        """Per prompt its first prompt ids and, with regenerate = "all", the template's ids
        before each later assistant turn (``ChatEncoder.encode_turns``); None: refused."""
        if self.settings.regenerate == "all":
            multi = [any(m["role"] == "assistant" for m in p.messages) for p in prompts]
            plain = [p for p, m in zip(prompts, multi, strict=True) if not m]
            single = iter(self._encode_batch(plain, report))
            return [self._encode_one(p, report, lambda p: self.encoder.encode_turns(
                        p.messages, p.tools)) if m
                    else next(single) for p, m in zip(prompts, multi, strict=True)]
        return self._encode_batch(prompts, report)

    def _encode_batch(self, prompts: list[Prompt], report: DatasetReport
                      ) -> list[Encoded | None]:
        if not prompts:
            return []
        try:
            return [(ids, []) for ids in self.encoder.encode_batch(
                [p.messages for p in prompts], [p.tools for p in prompts])]
        except ValueError:  # find the one the template refuses
            return [self._encode_one(p, report, lambda p: (self.encoder.encode(p.messages,
                                                                              p.tools), []))
                    for p in prompts]

    @staticmethod
    def _encode_one(prompt: Prompt, report: DatasetReport,
                    encode: Callable[[Prompt], Encoded]) -> Encoded | None:
        try:
            return encode(prompt)
        except ValueError as exc:
            report.bad.append(f"{prompt.source}: chat template failed: {exc}")
            return None

    def _send(self, dataset: str, jobs: list[Job], producer: object) -> None:
        # Pending first: a crash between the two leaves a pending entry that the
        # next producer run or sweep re-enqueues, never a task the ledger does not know.
        self.ledger.add_pending(dataset, {j.sample: json.dumps(j.payload()) for j in jobs})
        for job in jobs:
            enqueue(self.app, job, producer=producer)

    def _write_bad_report(self, report: DatasetReport) -> None:
        lines = report.bad + report.window
        if not lines:
            return
        path = Path(self.settings.output_dir) / REPORTS_DIR / f"{report.dataset}.bad.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")


@contextmanager
def _sent_events(app: Celery, enabled: bool) -> Iterator[None]:
    """Task-sent events on or off for the bulk enqueue only (see ``bulk_sent_events``)."""
    before = app.conf.task_send_sent_event
    app.conf.task_send_sent_event = enabled
    try:
        yield
    finally:
        app.conf.task_send_sent_event = before


def _batches(items: Iterable[Prompt | BadRecord], size: int
             ) -> Iterator[list[Prompt | BadRecord]]:
    batch: list[Prompt | BadRecord] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch
