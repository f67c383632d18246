"""The heartbeat's reaper against a real Redis: when lost work is given back."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from conftest import wait_until

from config.settings import Settings
from datagen import keys
from datagen.generation.job import Job
from datagen.generation.lease import LeaseBook
from datagen.generation.ledger import Ledger, connect
from datagen.generation.liveness import Heartbeat, reap


def test_a_stale_lease_is_reaped_at_its_deadline_not_at_a_later_beat(redis_url: str) -> None:
    # Given: a live worker's heartbeat (lease 12 s: it beats every 2 s and may reap once it has
    # been in touch with Redis for a lease), and a dead worker's request in flight
    lease_s = 12.0
    led = Ledger(connect(redis_url), Settings(redis_url=redis_url, lease_s=lease_s))
    led.register(["A"])
    led.mark_run()
    job = Job("A", "s1", "short", "prompts/A/x.jsonl", 0, 5, 100)
    led.add_pending("A", {"s1": json.dumps(job.payload())})
    assert led.admit("A", "s1", "r1", "dead-owner", 5, 100).status == "ok"
    requeued: list[tuple[Job, float]] = []

    def requeue(j: Job) -> None:
        sec, usec = led.r.time()
        requeued.append((j, sec + usec / 1e6))

    beat = Heartbeat(led, LeaseBook(led, "live-owner"), lease_s, requeue)
    beat.start()
    try:
        # When: the dead request's lease ends between two beats, half a second after the
        # heartbeat may first reap and 1.5 s before its next beat (the beats reaped every
        # other beat, the lock held half a lease: 7.5 s after this deadline)
        sec, usec = led.r.time()
        deadline = sec + usec / 1e6 + lease_s + 0.5
        led.r.zadd(led.k("A", keys.LEASES), {"s1": deadline})
        wait_until(lambda: requeued, 3 * lease_s, what="the stale request to be re-enqueued")
    finally:
        beat.stop()
    # Then: it was re-enqueued at its deadline, not at a later beat
    (again, at), = requeued
    assert again == job
    assert deadline <= at <= deadline + 1.0, at - deadline
    assert led.in_flight("A") == {}


def test_a_worker_cut_off_from_its_server_ends_its_leases_for_the_next_reap_pass(
        redis_url: str) -> None:
    # Given: two requests in flight of a worker whose server cannot be reached (lease 60 s)
    lease_s = 60.0
    led = Ledger(connect(redis_url), Settings(redis_url=redis_url, lease_s=lease_s))
    led.register(["A"])
    led.mark_run()
    jobs = [Job("A", f"s{i}", "short", "prompts/A/x.jsonl", i, 5, 100) for i in (1, 2)]
    led.add_pending("A", {j.sample: json.dumps(j.payload()) for j in jobs})
    book = LeaseBook(led, "cut-owner")
    leases = []
    for j in jobs:
        assert led.admit("A", j.sample, f"r-{j.sample}", "cut-owner", 5, 100).status == "ok"
        leases.append(book.hold("A", j.sample, f"r-{j.sample}"))
    requeued: list[Job] = []

    def deadline(sample: str) -> float:
        sec, usec = led.r.time()
        return led.r.zscore(led.k("A", keys.LEASES), sample) - (sec + usec / 1e6)

    # When: one request's thread gives up on the server (abandon), and the heartbeat beats
    # with the server lost
    leases[0].abandon()
    assert deadline("s1") <= 0 < deadline("s2")
    told: list[bool] = []
    beat = Heartbeat(led, book, lease_s, requeued.append, server_ok=lambda: False,
                     on_server=told.append)
    beat.beat()
    assert deadline("s2") > 0  # the beat renews: the server's check is the watcher's
    assert beat.check_server() is False
    beat.beat()

    # Then: both leases ended at the check, not a lease after their last renewal, and stay
    # ended through the beats; still in flight (not released: the reaper must abort their
    # rids on the server), and the next reap pass re-enqueues both
    assert told == [False]
    assert deadline("s2") <= 0
    assert set(led.in_flight("A")) == {"s1", "s2"}
    assert reap(led, requeued.append) == 2
    assert sorted(j.sample for j in requeued) == ["s1", "s2"]


def test_a_beat_that_finds_the_fleet_s_contact_gone_says_reaping_waits_a_lease(
        redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    # Given: a worker's heartbeat in touch with Redis (its first beat starts the contact)
    led = Ledger(connect(redis_url), Settings(redis_url=redis_url, lease_s=6.0))
    beat = Heartbeat(led, LeaseBook(led, "owner"), 6.0, lambda job: None)
    with caplog.at_level(logging.WARNING, logger="datagen.generation.liveness"):
        beat.beat()
        beat.beat()
        assert "reaping waits a lease" not in caplog.text

        # When: no beat reached Redis for half a lease (the mark expired), then one does
        led.r.delete(keys.CONTACT_SINCE)
        beat._tick()  # the beat, then the reap pass that follows a beat that got through

    # Then: one line says so, and this reaper looks again a lease from now, not before
    assert caplog.text.count("no worker reached Redis for 3.0s; reaping waits a lease") == 1
    assert time.monotonic() + 5.0 < beat._next_reap < time.monotonic() + 6.5


class BackAgain:
    """A server client whose server answers again (its health probes pass)."""

    base_url = "http://server-b"

    def reachable(self) -> bool:
        return True

    def healthy(self) -> bool:
        return True


def ledger_with_one_task(settings: Settings) -> tuple[Ledger, Job]:
    """A run's ledger with one task of dataset A (sample s1) pending."""
    led = Ledger(connect(settings.redis_url), settings)
    led.register(["A"])
    led.mark_run()
    job = Job("A", "s1", "short", "prompts/A/x.jsonl", 0, 5, 100)
    led.add_pending("A", {"s1": json.dumps(job.payload())})
    return led, job


def worker_with_one_task(redis_url: str, server: dict[str, bool]
                         ) -> tuple[Any, Ledger, Job, Heartbeat]:
    """A worker process's context (lease 60 s, up to 3 retries, a server client whose
    health probes pass), its heartbeat probing ``server["ok"]``, and one task of dataset A
    pending."""
    from datagen.generation import runner

    settings = Settings(redis_url=redis_url, lease_s=60.0, max_retries=3)
    led, job = ledger_with_one_task(settings)
    book = LeaseBook(led, "w1")
    beat = Heartbeat(led, book, settings.lease_s, lambda j: None, server_ok=lambda: server["ok"])
    ctx = runner.Context(settings, led, BackAgain(), None, "w1", book)  # type: ignore[arg-type]
    return ctx, led, job, beat


def test_a_request_whose_lease_ended_with_the_server_lost_is_left_to_the_reaper_when_it_is_back(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: a worker's request in flight (lease 60 s, up to 3 retries) while its heartbeat
    # finds the server lost (the leases end) and then back; the request's connection is dropped
    # only after that (the old server's socket reset, as when a host is replaced)
    from datagen.errors import ServerUnavailable
    from datagen.generation import runner

    server = {"ok": True}
    ctx, led, job, beat = worker_with_one_task(redis_url, server)
    sent: list[str] = []

    def generate(ctx: runner.Context, job: Job, lease: object) -> runner.Outcome:
        sent.append(ctx.leases.held()["A"][0][1])
        server["ok"] = False
        assert beat.check_server() is False  # the leases end
        server["ok"] = True
        assert beat.check_server() is True  # answered again: the beats renew what is held
        raise ServerUnavailable("Connection aborted: RemoteDisconnected")

    monkeypatch.setattr(runner, "_generate_admitted", generate)

    # When: the request's thread sees its connection dropped
    outcome = runner.run_job(ctx, job)

    # Then: it does not send the sample again (a reaper does, once): its lease is ended and
    # the sample still in flight under the one rid sent, for the next reap pass to abort and
    # re-enqueue
    assert outcome.status == "lapsing"
    assert len(sent) == 1
    assert {s: e["rid"] for s, e in led.in_flight("A").items()} == {"s1": sent[0]}
    assert not ctx.leases.lapsed(sent[0])  # the book keeps nothing of a lease it let go
    requeued: list[Job] = []
    assert reap(led, requeued.append) == 1 and requeued == [job]


def test_a_task_taken_after_the_server_was_lost_sends_nothing_and_goes_back_to_the_queue(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: a worker whose heartbeat found the server lost (it stops consuming), and a task
    # it had already taken
    from datagen.generation import runner

    server = {"ok": False}
    ctx, led, job, beat = worker_with_one_task(redis_url, server)
    book = ctx.leases
    book.hold("A", "other", "r-other")  # a request in flight, so the watch probes
    assert beat.check_server() is False
    sent: list[Job] = []
    monkeypatch.setattr(runner, "_generate_admitted",
                        lambda ctx, job, lease: sent.append(job))  # type: ignore[func-returns-value]

    # When: the task runs
    outcome = runner.run_job(ctx, job)

    # Then: no request was sent (one sent now could reach the server after the heal, beside
    # the reaper's re-run); the sample is handed back, not in flight; once the server
    # answers again, tasks run
    assert outcome.status == "requeue" and sent == []
    assert "s1" not in led.in_flight("A")
    server["ok"] = True
    assert beat.check_server() is True
    assert not book.server_lost.is_set()


def test_a_second_copy_of_a_running_sample_in_the_same_worker_waits_and_finds_it_done(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: a worker whose task of s1 is generating (admitted, its request not answered), and
    # a second copy of s1 taken by the same process (a sweep's or a reaper's re-enqueue):
    # admission lets an owner take its own entry over, so nothing in Redis tells them apart
    import threading

    from datagen.generation import runner

    ctx, led, job, _ = worker_with_one_task(redis_url, {"ok": True})
    entered, go, waiting = threading.Event(), threading.Event(), threading.Event()
    generated: list[str] = []

    def generate(ctx: runner.Context, job: Job, lease: Any) -> runner.Outcome:
        generated.append(lease.rid)
        entered.set()
        go.wait(60)
        lease.commit(prompt_tokens=5, completion_tokens=10, truncated=False, latency_s=0.1)
        return runner.Outcome("stored", 10)

    monkeypatch.setattr(runner, "_generate_admitted", generate)
    runs = ctx.leases._runs
    wait = runs.wait

    def noted_wait(timeout: float | None = None) -> bool:
        waiting.set()
        return wait(timeout)

    monkeypatch.setattr(runs, "wait", noted_wait)
    outcomes: list[str] = []
    threads = [threading.Thread(target=lambda: outcomes.append(runner.run_job(ctx, job).status))
               for _ in range(2)]
    threads[0].start()
    assert entered.wait(60)

    # When: the second copy runs while the first generates, then the first finishes
    threads[1].start()
    wait_until(lambda: waiting.is_set() or len(generated) > 1, 60, what="the second copy")
    go.set()
    for thread in threads:
        thread.join(60)

    # Then: one request was sent and one sample counted; the second copy found it done
    assert len(generated) == 1
    assert sorted(outcomes) == ["done", "stored"]
    assert led.snapshot("A")["stats"]["samples"] == 1


@contextmanager
def beating(beat: Heartbeat) -> Iterator[None]:
    """The worker's heartbeat, beating as fast as it can until the block ends."""
    import threading

    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            beat.beat()
            time.sleep(0.02)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)


def test_a_sweep_leaves_a_claimed_sample_alone_until_its_worker_ends_it_or_dies(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: a pending sample with no message queued and nothing in flight, whose task a live
    # worker has taken (acked early) but not yet admitted: the task claims it, and no beat
    # has published that claim yet when the sweep looks
    import threading

    from datagen.generation import liveness
    from datagen.generation.liveness import sweep

    ctx, led, job, beat = worker_with_one_task(redis_url, {"ok": True})
    beat.beat()  # the worker is up: its presence and its (empty) claims published
    looked = threading.Event()
    published_since = liveness._published_since

    def noted(*args: Any) -> bool:
        looked.set()  # the sweep found the sample nowhere and waits for the beats
        return published_since(*args)

    monkeypatch.setattr(liveness, "_published_since", noted)
    requeued: list[Job] = []
    out: list[int] = []
    with ctx.leases.running("A", "s1"):
        sweeping = threading.Thread(target=lambda: out.append(sweep(led, requeued.append, 60)))
        sweeping.start()
        assert looked.wait(60)

        # When: the worker's next beats come
        with beating(beat):
            sweeping.join(60)

        # Then: the sweep saw the claim in them and re-enqueued nothing
        assert out == [0] and requeued == []

    # When: the task ended without admitting it, Then: the sweep gives the sample back
    with beating(beat):
        assert sweep(led, requeued.append, 60) == 1 and requeued == [job]

    # And: a live worker that does not beat holds a sweep back (it looks again later)
    looked.clear()
    assert sweep(led, requeued.append, 0.2) == 0 and looked.is_set()

    # And: a dead worker's claims hold one lease at most (their TTL; the expiry is what the
    # deletes below do), and a sweep waits for no worker whose claims are gone
    led.r.delete(keys.worker_claims("w1"))
    led.publish_claims("w2", [("A", "s1")])
    assert sweep(led, requeued.append, 60) == 0
    assert 0 < led.r.pttl(keys.worker_claims("w2")) <= led.settings.lease_s * 1000
    led.r.delete(keys.worker_claims("w2"))
    assert sweep(led, requeued.append, 60) == 1 and requeued == [job, job]


class Resolver:
    """``socket.getaddrinfo`` with the server's name failing ``failures`` times (None: for
    good) with EAI_NONAME, as a container network's DNS does; then it resolves to 127.0.0.1."""

    def __init__(self, name: str, failures: int | None):
        import socket

        self.name, self.failures, self.failed = name, failures, 0
        self._real = socket.getaddrinfo

    def __call__(self, host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        import socket

        if host == self.name:
            if self.failures is None or self.failed < self.failures:
                self.failed += 1
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            host = "127.0.0.1"
        return self._real(host, port, *args, **kwargs)


@contextmanager
def server_named(monkeypatch: pytest.MonkeyPatch, failures: int | None
                 ) -> Iterator[tuple[str, Resolver]]:
    """A listening server's URL under a name the patched resolver answers for."""
    import socket

    resolver = Resolver("datagen-server.test", failures)
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        yield f"http://datagen-server.test:{listener.getsockname()[1]}", resolver
    finally:
        listener.close()


def test_a_name_that_fails_to_resolve_for_a_moment_ends_no_lease(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: a worker's request in flight (lease 60 s: a grace of 30 s for its server's
    # name), its heartbeat probing the server through the client, and a resolver that fails
    # three lookups of the server's name, then answers (Podman's DNS on a loaded host)
    from datagen.client import UNRESOLVED_GRACE_LEASES, SGLangClient

    lease_s = 60.0
    led, _ = ledger_with_one_task(Settings(redis_url=redis_url, lease_s=lease_s))
    book = LeaseBook(led, "w1")
    assert led.admit("A", "s1", "r1", "w1", 5, 100).status == "ok"
    book.hold("A", "s1", "r1")
    told: list[bool] = []
    with server_named(monkeypatch, failures=3) as (url, resolver):
        client = SGLangClient(url, unresolved_grace_s=lease_s * UNRESOLVED_GRACE_LEASES)
        beat = Heartbeat(led, book, lease_s, lambda j: None, server_ok=client.reachable,
                         on_server=told.append)
        # When: the watcher probes through the failures and after them
        probes = [beat.check_server() for _ in range(5)]
    # Then: no probe lost the server; the lease was never ended, so no reaper re-runs the
    # sample beside its request (nothing stored twice)
    assert resolver.failed == 3 and probes == [True] * 5 and told == []
    assert not book.lapsed("r1") and not book.server_lost.is_set()
    sec, usec = led.r.time()
    assert led.r.zscore(led.k("A", keys.LEASES), "s1") > sec + usec / 1e6
    assert reap(led, lambda j: None) == 0
    assert {s: e["rid"] for s, e in led.in_flight("A").items()} == {"s1": "r1"}


def test_a_name_gone_for_good_loses_the_server_after_the_grace_and_the_task_does_not_stall(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: a worker (lease 2 s: a grace of 1 s) whose server's name stopped resolving for
    # good (its container removed), its heartbeat running, and a task of s1 whose request
    # fails on the name
    import threading

    from datagen.client import UNRESOLVED_GRACE_LEASES, SGLangClient
    from datagen.generation import runner

    settings = Settings(redis_url=redis_url, lease_s=2.0, max_retries=3)
    led, job = ledger_with_one_task(settings)
    book = LeaseBook(led, "w1")
    told: list[bool] = []
    sent: list[str] = []

    def generate(ctx: runner.Context, job: Job, lease: Any) -> runner.Outcome:
        sent.append(lease.rid)
        ctx.client.generate([1, 2, 3], {"max_new_tokens": 4}, lease.rid)
        raise AssertionError("the name resolved")

    monkeypatch.setattr(runner, "_generate_admitted", generate)
    with server_named(monkeypatch, failures=None) as (url, _):
        client = SGLangClient(url, kind="sglang",
                              unresolved_grace_s=settings.lease_s * UNRESOLVED_GRACE_LEASES)
        ctx = runner.Context(settings, led, client, None, "w1", book)  # type: ignore[arg-type]
        beat = Heartbeat(led, book, settings.lease_s, lambda j: None,
                         server_ok=client.reachable, on_server=told.append)
        beat.start()
        try:
            # When: the task runs (the old rule, every failed lookup "reachable", kept its
            # retry waiting on the server's health for an hour)
            outcome: list[runner.Outcome] = []
            task = threading.Thread(target=lambda: outcome.append(runner.run_job(ctx, job)),
                                    daemon=True)
            task.start()
            task.join(120)
        finally:
            beat.stop()
    # Then: the heartbeat lost the server once its name stayed unknown past the grace, and the
    # task ended: the sample handed back to the queue (or, if the grace had run out before
    # its own check, its lease ended for a reaper); never sent twice from here
    assert not task.is_alive(), "the task still waits on a server whose name is gone"
    assert told == [False] and book.server_lost.is_set()
    (done,) = outcome
    assert done.status in ("requeue", "lapsing"), done
    assert len(sent) == 1
    if done.status == "requeue":
        assert led.in_flight("A") == {}
    else:
        assert reap(led, lambda j: None) == 1
