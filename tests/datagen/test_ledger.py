"""The ledger's Lua steps against a real Redis, and the length model they rely on."""

from __future__ import annotations

import json
import math
import random
import time

import pytest
import redis

from config.settings import Settings
from datagen import keys
from datagen.celery_app import make_app
from datagen.generation import guard
from datagen.generation.admission import (
    BUCKET_COUNT,
    CAP_CLASSES,
    PRIOR_TOKENS_PER_S,
    Bucket,
    bucket_field,
    encode_model,
    stored,
)
from datagen.generation.ledger import Ledger, connect, length_model
from datagen.operations import status


@pytest.fixture
def ledger(redis_url: str) -> Ledger:
    led = Ledger(connect(redis_url), Settings(redis_url=redis_url, token_budget=1000))
    led.register(["A"])
    led.mark_run()
    return led


def test_a_sample_delivered_twice_is_counted_once(ledger: Ledger) -> None:
    assert ledger.admit("A", "s1", "r1", "w", 5, 100).status == "ok"
    first = ledger.commit("A", "s1", "r1", 5, 300, False, 1.0)
    second = ledger.commit("A", "s1", "r2", 5, 280, False, 1.0)
    assert first.committed and not second.committed
    snap = ledger.snapshot("A")
    assert snap["tokens"] == 300
    assert snap["stats"]["samples"] == 1 and snap["stats"]["duplicates"] == 1
    assert ledger.r.hget(ledger.k("A", "done"), "s1") == "r1 300"


def test_admission_refuses_done_busy_and_closed_samples(ledger: Ledger) -> None:
    assert ledger.admit("A", "s1", "r1", "w", 5, 100).status == "ok"
    assert ledger.admit("A", "s1", "r2", "other-worker", 5, 100).status == "busy"
    ledger.commit("A", "s1", "r1", 5, 10, False, 1.0)
    assert ledger.admit("A", "s1", "r3", "w", 5, 100).status == "done"
    ledger.close("A", "operator")
    assert ledger.admit("A", "s2", "r4", "w", 5, 100).status == "closed"


def test_commit_that_reaches_the_budget_closes_the_dataset(ledger: Ledger) -> None:
    ledger.admit("A", "s1", "r1", "w", 5, 2000)
    result = ledger.commit("A", "s1", "r1", 5, 1200, False, 1.0)
    assert result.closed_now and ledger.closed("A") == "budget"
    assert ledger.admit("A", "s2", "r2", "w", 5, 100).status == "closed"


def test_total_measure_counts_prompt_tokens(redis_url: str) -> None:
    led = Ledger(connect(redis_url), Settings(redis_url=redis_url, budget_counts="total"))
    led.register(["A"])
    led.mark_run()
    led.admit("A", "s1", "r1", "w", 40, 100)
    led.commit("A", "s1", "r1", 40, 60, False, 1.0)
    assert led.snapshot("A")["tokens"] == 100


def test_trainable_measure_counts_the_tokens_inside_the_window_beside_the_generated(
        redis_url: str) -> None:
    led = Ledger(connect(redis_url), Settings(redis_url=redis_url, budget_counts="trainable",
                                              token_budget=1000))
    led.register(["A"])
    led.mark_run()
    led.admit("A", "s1", "r1", "w", 1500, 548)
    first = led.commit("A", "s1", "r1", 1500, 3000, True, 1.0, trainable_tokens=548)
    assert not first.closed_now
    led.admit("A", "s2", "r2", "w", 1500, 548)
    second = led.commit("A", "s2", "r2", 1500, 3000, True, 1.0, trainable_tokens=548)
    snap = led.snapshot("A")
    # the budget closes on what trains; the generated total stays beside it
    assert second.closed_now and snap["tokens"] == 1096
    assert snap["stats"]["completion_tokens"] == 6000
    assert led.r.hget(led.k("A", "done"), "s2") == "r2 548"
    row = status.rows(led)[0]
    assert (row.tokens, row.generated) == (1096, 6000)


def test_max_samples_closes_the_dataset(redis_url: str) -> None:
    led = Ledger(connect(redis_url), Settings(redis_url=redis_url, max_samples=2))
    led.register(["A"])
    led.mark_run()
    for i in range(2):
        led.admit("A", f"s{i}", f"r{i}", "w", 1, 10)
        last = led.commit("A", f"s{i}", f"r{i}", 1, 5, False, 1.0)
    assert last.closed_now and led.closed("A") == "max_samples"


def test_admission_waits_while_in_flight_requests_would_fill_the_budget(ledger: Ledger) -> None:
    # Without a learnt model each in-flight request is assumed to reach its cap.
    assert ledger.admit("A", "s1", "r1", "w", 5, 400).status == "ok"
    assert ledger.admit("A", "s2", "r2", "w", 5, 400).status == "ok"
    assert ledger.admit("A", "s3", "r3", "w", 5, 400).status == "wait"
    # The naive rule admits anything while the counter is under the budget.
    assert ledger.admit("A", "s3", "r3", "w", 5, 400, precise=False).status == "ok"


def test_admission_never_leaves_a_dataset_short_when_nothing_is_in_flight(
        ledger: Ledger) -> None:
    ledger.admit("A", "s1", "r1", "w", 5, 5000)
    ledger.commit("A", "s1", "r1", 5, 900, False, 1.0)
    # 100 tokens of room, a cap of 5,000: still admitted, since nothing else is running.
    assert ledger.admit("A", "s2", "r2", "w", 5, 5000).status == "ok"


def test_admission_admits_whatever_fits_at_the_caps_whatever_the_model_says(
        ledger: Ledger) -> None:
    # Given: a length model that is mostly prior (its spread alone fills the budget of 1,000)
    ledger.r.set(ledger.k("A", keys.MODEL), json.dumps(
        {"t": [0, 100], "m": [100.0, 100.0], "v": [1e6, 1e6], "tail": 1.0, "mean": 100.0,
         "var": 1e6, "rate": 50.0, "n": 1, "censored": 0}))
    assert ledger.admit("A", "s1", "r1", "w", 5, 200).status == "ok"  # nothing in flight
    # When/Then: four more fit even if every one of them runs to its cap of 200 ...
    assert [ledger.admit("A", f"s{i}", f"r{i}", "w", 5, 200).status
            for i in (2, 3, 4, 5)] == ["ok", "ok", "ok", "ok"]
    # ... and the sixth would not: 6 x 200 > 1,000, and the model's sd says no either
    assert ledger.admit("A", "s6", "r6", "w", 5, 200).status == "wait"


def test_a_fresh_request_is_expected_at_most_at_its_own_cap(ledger: Ledger) -> None:
    # Given: a model whose mean (5,000) comes from long responses, a budget of 1,000, and
    # one request in flight with a cap of 10,000 that the model expects at 300
    ledger.r.set(ledger.k("A", keys.MODEL), json.dumps(
        {"t": [0], "m": [300.0], "v": [0.0], "tail": 1.0, "mean": 5000.0, "var": 0.0,
         "rate": 1e-3, "n": 20, "censored": 0}))
    assert ledger.admit("A", "s1", "r1", "w", 5, 10_000).status == "ok"
    # Then: a request capped at 100 is reserved at 100, not at the model's 5,000
    assert ledger.admit("A", "s2", "r2", "w", 5, 100).status == "ok"


def test_the_length_model_starts_at_the_first_response_and_is_mostly_prior() -> None:
    # One response of 300 and nothing in flight: the model exists, and 2 of the 3
    # observations' mass (the pseudo-observations) sits at the cap.
    model = length_model([300], 1.0, 1.0, cap=10240)
    assert model is not None
    assert model["mean"] == pytest.approx(300 / 3 + 2 * 10240 / 3, rel=1e-6)
    # It gives way to the data as responses accumulate (2/(n + 2) of the mass at the cap).
    many = length_model([300] * 98, 1.0, 1.0, cap=10240)
    assert many is not None and many["mean"] == pytest.approx(0.98 * 300 + 0.02 * 10240)
    assert length_model([300] * 15, 1.0, 1.0, cap=10240, min_samples=16) is None


def test_release_only_drops_its_own_entry(ledger: Ledger) -> None:
    ledger.admit("A", "s1", "r1", "w", 5, 10)
    ledger.release("A", "s1", "other-rid")
    assert "s1" in ledger.in_flight("A")
    ledger.release("A", "s1", "r1")
    assert ledger.in_flight("A") == {}


def _lognormal(n: int, mean: float, sigma: float, cap: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    mu = math.log(mean) - sigma * sigma / 2
    return [min(cap, max(1, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def test_pending_ids_are_the_pending_samples_without_payloads(ledger: Ledger) -> None:
    ledger.add_pending("A", {"s1": '{"big": 1}', "s2": "{}"})
    assert ledger.pending_ids("A") == {"s1", "s2"}
    assert ledger.pending_ids("B") == set()


def test_a_close_drops_the_pending_payloads_and_status_queues_nothing(
        ledger: Ledger) -> None:
    # Given: queued work of two datasets
    ledger.add_pending("A", {"s1": "{}", "s2": "{}"})
    ledger.add_pending("B", {"s3": "{}"})
    # When: A closes through the guard (a real stamped revoke over this Redis)
    assert guard.close(make_app(ledger.settings), ledger, "A", "operator")
    # Then: A has nothing pending any more, B keeps its work
    assert ledger.pending("A") == {} and ledger.snapshot("A")["pending"] == 0
    assert ledger.pending_ids("B") == {"s3"}
    [row] = [r for r in status.rows(ledger) if r.dataset == "A"]
    assert row.queued == 0 and row.state == "closed (operator)"


def test_length_model_conditional_means_match_the_data_and_grow() -> None:
    xs = _lognormal(5000, 3700, 1.0, 10240, seed=3)
    model = length_model(xs, 1.0, 1.0)
    assert model is not None
    assert model["mean"] == pytest.approx(sum(xs) / len(xs), rel=0.01)
    assert all(b >= a - 1e-6 for a, b in zip(model["m"], model["m"][1:], strict=False))
    t = model["t"][len(model["t"]) // 2]
    above = [x for x in xs if x > t]
    assert model["m"][len(model["t"]) // 2] == pytest.approx(sum(above) / len(above), rel=0.01)


def test_length_model_corrects_the_short_bias_of_early_completions() -> None:
    # Given: requests started at staggered times; the ones done so far are biased short
    truth = _lognormal(600, 3700, 1.0, 10240, seed=5)
    rng = random.Random(9)
    done, in_flight = [], []
    for length in truth:
        progress = 6000 - rng.uniform(0, 5000)
        if length <= progress:
            done.append(length)
        else:
            in_flight.append(progress)
    naive = sum(done) / len(done)
    # When: the model counts in-flight requests as censored observations (L > progress)
    model = length_model(done, 1.0, 1.0, in_flight, cap=10240)
    # Then: its mean is far closer to the truth than the mean of completed lengths
    true_mean = sum(truth) / len(truth)
    assert abs(model["mean"] - true_mean) < 0.25 * abs(naive - true_mean)


def test_tokens_per_second_over_the_last_minute(ledger: Ledger) -> None:
    assert ledger.tokens_per_s("A") is None
    for i, tokens in enumerate((100, 200, 300)):
        ledger.admit("A", f"s{i}", f"r{i}", "w", 1, 400)
        ledger.commit("A", f"s{i}", f"r{i}", 1, tokens, False, 1.0)
        time.sleep(0.2)
    rate = ledger.tokens_per_s("A")
    # 500 tokens committed after the first commit, over ~0.6 s
    assert rate is not None and 500 / 1.5 < rate < 500 / 0.35


# -- ledger v2: buckets, leases, parking, the run marker -------------------------------


def _ledger(redis_url: str, **settings: object) -> Ledger:
    led = Ledger(connect(redis_url), Settings(redis_url=redis_url, **settings))
    led.register(["A"])
    led.mark_run()
    return led


def test_admission_reads_buckets_that_follow_admits_and_releases(ledger: Ledger) -> None:
    # Given: 300 requests admitted under a budget large enough for all
    ledger.set_budget("A", 10**9)
    for i in range(300):
        assert ledger.admit("A", f"s{i}", f"r{i}", "w", 7, 100).status == "ok"
    buckets = ledger.buckets("A")
    # Then: a few buckets hold them all, with their caps and prompt tokens
    assert sum(b.count for b in buckets) == 300
    assert sum(b.caps for b in buckets) == 100 * 300
    assert int(ledger.r.hget(ledger.k("A", "buckets"), "_prompt")) == 7 * 300
    assert len(buckets) <= 3
    # When: every one ends (half committed, half released), the buckets empty out
    for i in range(300):
        if i % 2:
            ledger.commit("A", f"s{i}", f"r{i}", 7, 50, False, 1.0)
        else:
            ledger.release("A", f"s{i}", f"r{i}")
    buckets = ledger.r.hgetall(ledger.k("A", "buckets"))
    assert {f: int(v) for f, v in buckets.items()} in ({}, {"_prompt": 0})
    assert ledger.in_flight("A") == {} and ledger.r.zcard(ledger.k("A", "leases")) == 0


def test_entries_start_at_redis_time_not_the_hosts(ledger: Ledger) -> None:
    sec, usec = ledger.r.time()
    ledger.admit("A", "s1", "r1", "w", 5, 100)
    start = ledger.in_flight("A")["s1"]["start"]
    assert abs(start - (sec + usec / 1e6)) < 5


def test_a_stale_lease_is_reclaimed_whoever_owns_it_and_a_live_one_is_not(
        redis_url: str) -> None:
    led = _ledger(redis_url, lease_s=0.3)
    led.add_pending("A", {"s1": '{"sample": "s1"}', "s2": '{"sample": "s2"}'})
    led.admit("A", "s1", "r1", "host-1-aaaaaa", 5, 100, server="http://gpu-1:30000")
    led.admit("A", "s2", "r2", "host-1-bbbbbb", 5, 100)
    # When: only s2's owner renews, past the lease
    time.sleep(0.2)
    assert led.renew({"A": [("s2", "r2"), ("s1", "not-its-rid")]}) == 1
    time.sleep(0.2)
    reclaimed = led.reap("A")
    # Then: s1 is reclaimed with its payload, and the rid and server to abort; s2 stays
    assert [(r.sample, r.payload, r.worker, r.rid, r.server) for r in reclaimed] == [
        ("s1", '{"sample": "s1"}', "host-1-aaaaaa", "r1", "http://gpu-1:30000")]
    assert set(led.in_flight("A")) == {"s2"}
    assert led.snapshot("A")["stats"]["reaped"] == 1
    assert led.reap("A") == []  # exactly one reaper gets each entry


def test_a_reap_waits_for_the_fleets_contact_with_redis_when_it_runs(redis_url: str) -> None:
    # Given: a stale entry, and no contact marked yet (a partition just healed, say)
    led = _ledger(redis_url, lease_s=0.2)
    led.add_pending("A", {"s1": '{"sample": "s1"}'})
    led.admit("A", "s1", "r1", "gone-owner", 5, 100)
    time.sleep(0.3)
    # When/Then: a reap that needs a lease of contact reclaims nothing until there has been
    # that much, measured when the script runs
    assert led.reap("A", min_contact_s=0.5) == []
    lasted, began = led.contact(ttl_s=5.0)
    assert began and lasted < 0.1  # a beat starts the stretch of contact
    assert led.reap("A", min_contact_s=0.5) == []
    time.sleep(0.6)
    lasted, began = led.contact(ttl_s=5.0)
    assert not began and lasted >= 0.5  # later beats keep its start
    assert [r.sample for r in led.reap("A", min_contact_s=0.5)] == ["s1"]
    # ... and once no beat kept it alive, contact starts over
    led.r.pexpire(keys.CONTACT_SINCE, 1)
    time.sleep(0.05)
    lasted, began = led.contact(ttl_s=5.0)
    assert began and lasted < 0.1


def test_a_stale_entry_does_not_block_a_new_admission(redis_url: str) -> None:
    led = _ledger(redis_url, lease_s=0.2)
    led.admit("A", "s1", "r1", "dead-owner", 5, 100)
    assert led.admit("A", "s1", "r2", "new-owner", 5, 100).status == "busy"
    time.sleep(0.3)
    assert led.admit("A", "s1", "r2", "new-owner", 5, 100).status == "ok"
    assert led.in_flight("A")["s1"]["rid"] == "r2"
    assert sum(b.count for b in led.buckets("A")) == 1


def test_an_owner_takes_over_its_own_earlier_try(ledger: Ledger) -> None:
    # A release lost in a Redis blip must not make the owner's retry wait for the lease.
    ledger.admit("A", "s1", "r1", "w", 5, 100)
    assert ledger.admit("A", "s1", "r2", "w", 5, 100).status == "ok"
    assert ledger.in_flight("A")["s1"]["rid"] == "r2"


def test_a_refused_sample_is_parked_and_woken_by_a_commit(ledger: Ledger) -> None:
    # Given: two requests at their cap fill the budget of 1,000
    ledger.add_pending("A", {f"s{i}": f'{{"n": {i}}}' for i in range(4)})
    assert ledger.admit("A", "s0", "r0", "w", 5, 400).status == "ok"
    assert ledger.admit("A", "s1", "r1", "w", 5, 400).status == "ok"
    # When: two more are refused, they are parked, and shown as waiting
    assert ledger.admit("A", "s2", "r2", "w", 5, 400).status == "wait"
    assert ledger.admit("A", "s3", "r3", "w", 5, 400).status == "wait"
    assert ledger.parked("A") == {"s2", "s3"}
    assert ledger.snapshot("A")["waiting"] == 2
    # Then: a commit frees room for one more at its cap: the oldest parked is woken, for the
    # worker to enqueue
    result = ledger.commit("A", "s0", "r0", 5, 100, False, 1.0)
    assert result.woken == ['{"n": 2}']
    assert ledger.parked("A") == {"s3"}
    # ... and a release frees room for the other
    assert ledger.release("A", "s1", "r1") == ['{"n": 3}']
    assert ledger.parked("A") == set()


def test_a_close_drops_parked_samples_and_admission_that_finds_the_budget_full_closes(
        ledger: Ledger) -> None:
    ledger.add_pending("A", {"s9": "{}"})
    ledger.admit("A", "s0", "r0", "w", 5, 2000)
    ledger.admit("A", "s1", "r1", "w", 5, 2000)
    assert ledger.admit("A", "s9", "r9", "w", 5, 2000).status == "wait"
    ledger.set_budget("A", 0)  # lowered by hand, below what is committed
    adm = ledger.admit("A", "s9", "r9", "w", 5, 2000)
    # The admission that finds the budget full closes it and says so, once
    assert adm.status == "closed" and adm.closed_now
    assert ledger.closed("A") == "budget" and ledger.parked("A") == set()
    assert not ledger.admit("A", "s8", "r8", "w", 5, 10).closed_now


def test_without_the_run_marker_nothing_is_admitted_or_counted(ledger: Ledger) -> None:
    ledger.admit("A", "s1", "r1", "w", 5, 100)
    ledger.unmark_run()
    assert ledger.admit("A", "s2", "r2", "w", 5, 100).status == "lost"
    result = ledger.commit("A", "s1", "r1", 5, 50, False, 1.0)
    assert result.lost and not result.committed
    assert ledger.snapshot("A")["tokens"] == 0 and ledger.committed("A") == {}
    assert ledger.mark_run() and not ledger.mark_run()
    assert ledger.commit("A", "s1", "r1", 5, 50, False, 1.0).committed


def test_a_commit_clears_the_samples_dead_letter(ledger: Ledger) -> None:
    ledger.dead_letter("A", "s1", "server unavailable after 3 tries")
    assert ledger.snapshot("A")["dead"] == 1
    ledger.admit("A", "s1", "r1", "w", 5, 100)
    ledger.commit("A", "s1", "r1", 5, 50, False, 1.0)
    assert ledger.dead("A") == {} and ledger.snapshot("A")["dead"] == 0


def test_buckets_always_count_exactly_the_entries_in_flight(redis_url: str) -> None:
    # Given: random admits (caps repeated and distinct), commits, releases, takeovers and
    # reclaims of 40 samples
    led = _ledger(redis_url, lease_s=0.05, token_budget=10**9)
    rng = random.Random(7)
    rids: dict[str, str] = {}
    for step in range(600):
        sample = f"s{rng.randrange(40)}"
        action = rng.random()
        if action < 0.5:
            rid = f"r{step}"
            owner = rng.choice(["w1", "w2"])
            cap = rng.choice([100, 200, rng.randrange(1, 20000)])
            if led.admit("A", sample, rid, owner, 5, cap).status == "ok":
                rids[sample] = rid
        elif action < 0.7 and sample in rids:
            led.commit("A", sample, rids.pop(sample), 5, 10, False, 1.0)
        elif action < 0.9 and sample in rids:
            led.release("A", sample, rids.pop(sample))
        elif action < 0.92:
            time.sleep(0.06)
            led.reap("A")
        # Then: after every step, the buckets admission reads hold exactly what is in flight
        flight = led.in_flight("A")
        buckets = led.buckets("A")
        assert sum(b.count for b in buckets) == len(flight) == led.r.zcard(
            led.k("A", "leases")), step
        assert sum(b.caps for b in buckets) == sum(e["max_new_tokens"]
                                                   for e in flight.values()), step


# -- cap classes: admission's work stays bounded whatever the caps ---------------------


def test_buckets_stay_bounded_when_every_request_has_its_own_cap(redis_url: str) -> None:
    # Given: 2,000 requests, each with a cap of its own (long prompts get context - prompt - 1)
    led = _ledger(redis_url, token_budget=10**12)
    # (the largest cap first: it sets the time grid, so the grid is the same for all 2,000
    # however long they take to admit on a loaded machine)
    caps = [8 + 8 * i for i in reversed(range(2000))]
    for i, cap in enumerate(caps):
        assert led.admit("A", f"s{i}", f"r{i}", "w", 5, cap).status == "ok"
    # Then: admission reads a bucket per (start, cap class: [4^k, 4^(k+1))), not one per
    # request: the starts are those of a grid of the largest cap's duration / 32 (16,000 / 50
    # tok/s / 32 = 10 s)
    starts = [e["start"] for e in led.in_flight("A").values()]
    grid = max(starts) // 10 - min(starts) // 10 + 1
    classes = len({(cap.bit_length() - 1) // 2 for cap in caps})
    fields = led.r.hlen(led.k("A", keys.BUCKETS)) - 1  # less "_prompt"
    assert classes == 6 and fields <= grid * classes < 2000 / 10
    # ... and they still hold exactly the requests and caps in flight
    buckets = led.buckets("A")
    assert len(buckets) == fields
    assert sum(b.count for b in buckets) == 2000 and sum(b.caps for b in buckets) == sum(caps)


def _expected_final(model: dict, p: float) -> float:
    """lua/_lib.lua's expected_final (with a model): E[L | L > p]."""
    t, m = model["t"], model["m"]
    if p >= t[-1]:
        return p + model["tail"]
    hi = next(i for i, x in enumerate(t) if x > p)
    lo = hi - 1
    w = (p - t[lo]) / max(1, t[hi] - t[lo])
    return max(m[lo] + w * (m[hi] - m[lo]), p)


def test_distinct_caps_never_count_below_what_each_request_would(redis_url: str) -> None:
    # Given: a length model of lognormal lengths (mean 3.7K) decoding at 400 tok/s, and 600
    # requests in flight with caps of their own, 100-16,000
    led = _ledger(redis_url, token_budget=10**12, admission_margin_sd=0.0)
    rng = random.Random(5)
    lengths = [min(16384, max(1, int(rng.lognormvariate(math.log(3700) - 0.5, 1.0))))
               for _ in range(2000)]
    model = stored(length_model(lengths, 400.0, 1.0, cap=16384))
    led.r.set(led.k("A", keys.MODEL), json.dumps(model))
    caps = rng.sample(range(100, 16000), 600)
    for i, cap in enumerate(caps):
        assert led.admit("A", f"s{i}", f"r{i}", "w", 5, cap).status == "ok"
    # When: admission sums what they will count (the next request's own is not in it)
    entries = list(led.in_flight("A").values())

    def each_counted(now: float) -> float:
        # What buckets of one cap each (the rule before cap classes) count: every request
        # min(E[L | L > p], its cap), p from its bucket's start on the same time grid.
        total = 0.0
        for e in entries:
            start = int(e["b"]) // CAP_CLASSES
            total += min(_expected_final(model, max(0.0, now - start) * model["rate"]),
                         e["max_new_tokens"])
        return total

    sec, usec = led.r.time()
    before = each_counted(sec + usec / 1e6)
    counted = led.admit("A", "probe", "rp", "w", 5, 100).expected_in_flight
    sec, usec = led.r.time()
    after = each_counted(sec + usec / 1e6)
    # Then: never less than each request counted alone, and not much more
    assert math.floor(before) <= counted <= 1.05 * after


@pytest.mark.parametrize("encoding", ["msgpack", "json (as stored before)"])
def test_admission_counts_every_bucket_as_the_model_says(redis_url: str, encoding: str
                                                          ) -> None:
    # Given: a length model (lognormal, mean 3.7K, 40 tok/s) and 3,000 requests in flight
    # whose starts spread over the last 300 s with caps of their own, 200-16,000: many
    # starts, each at another progress, some past the model's last threshold
    led = _ledger(redis_url, token_budget=10**12, admission_margin_sd=0.0)
    rng = random.Random(11)
    lengths = [min(16384, max(1, int(rng.lognormvariate(math.log(3700) - 0.5, 1.0))))
               for _ in range(2000)]
    raw = length_model(lengths, 40.0, 1.0, cap=16384)
    model = stored(raw)
    led.r.set(led.k("A", keys.MODEL),
              encode_model(raw) if encoding == "msgpack" else json.dumps(model))
    sec, usec = led.r.time()
    now = sec + usec / 1e6
    caps = [rng.randrange(200, 16000) for _ in range(3000)]
    led.r.hset(led.k("A", keys.STATS), "cap", max(caps))
    fields: dict[str, int] = {}
    for cap in caps:
        field = bucket_field(now - rng.uniform(0, 300), cap, max(caps), model["rate"])
        fields[field] = fields.get(field, 0) + cap * BUCKET_COUNT + 1
    led.r.hset(led.k("A", keys.BUCKETS), mapping=fields)

    def by_the_model(at: float) -> float:
        # lua/_lib.lua's rule: n requests of a bucket count min(n * E[L | L > p], their caps)
        return sum(min(b.count * _expected_final(model, max(0.0, at - b.start) * model["rate"]),
                       b.caps) for b in led.buckets("A"))

    sec, usec = led.r.time()
    before = by_the_model(sec + usec / 1e6)
    counted = led.admit("A", "probe", "rp", "w", 5, 100).expected_in_flight
    sec, usec = led.r.time()
    after = by_the_model(sec + usec / 1e6)
    # Then: what admission counts is the model's sum at the moment it ran (it grows with time)
    assert len(fields) > 60
    assert math.floor(before) <= counted <= after


def test_the_model_is_written_for_these_scripts_and_as_json_for_earlier_versions(
        ledger: Ledger) -> None:
    # A machine of an earlier version may still run against this Redis while newer ones join:
    # it reads the model as JSON under the old key, so both are written at every refresh.
    ledger.set_budget("A", 10**9)
    for i in range(30):
        assert ledger.admit("A", f"s{i}", f"r{i}", "w", 5, 2000).status == "ok"
        ledger.commit("A", f"s{i}", f"r{i}", 5, 100 + 10 * i, False, 1.0)
    model = ledger.refresh_model("A")
    assert model is not None
    raw = redis.Redis(**{**ledger.r.connection_pool.connection_kwargs,
                         "decode_responses": False})
    packed = raw.get(ledger.k("A", keys.MODEL))
    assert packed == encode_model(model) and packed[:1] != b"{"
    assert json.loads(ledger.r.get(ledger.k("A", keys.MODEL_JSON))) == stored(model)
    # ... and the scripts read the MessagePack one as the JSON one was read
    decoded = ledger.r.eval("return cjson.encode(cmsgpack.unpack(redis.call('GET', KEYS[1])))",
                            1, ledger.k("A", keys.MODEL))
    got, want = json.loads(decoded), stored(model)
    assert got.keys() == want.keys()
    for key, value in want.items():  # (cjson prints 14 digits)
        assert got[key] == pytest.approx(value, rel=1e-12), key


def test_the_benchmarks_bucket_field_is_the_scripts(ledger: Ledger) -> None:
    # bench/bench_ledger.py writes in-flight state directly with admission.bucket_field
    ledger.set_budget("A", 10**12)
    for i, cap in enumerate((1, 100, 10240, 16384, 70000)):
        ledger.admit("A", f"s{i}", f"r{i}", "w", 5, cap)
        entry = ledger.in_flight("A")[f"s{i}"]
        cap_max = int(ledger.r.hget(ledger.k("A", keys.STATS), "cap"))
        assert entry["b"] == bucket_field(entry["start"], cap, cap_max, PRIOR_TOKENS_PER_S)


def test_a_bucket_past_two_to_the_53_is_read_exactly(ledger: Ledger) -> None:
    # Given: a bucket holding 5 requests whose caps sum to 2^35 + 12,345 (its value is past
    # 2^53, where a double drops low bits)
    caps = 2**35 + 12_345
    field = bucket_field(1000.0, 2**30, 2**30, PRIOR_TOKENS_PER_S)
    ledger.r.hset(ledger.k("A", keys.BUCKETS), field, caps * BUCKET_COUNT + 5)
    ledger.set_budget("A", 10**15)
    # Then: admission (no model yet: every request at its cap) reads both parts right
    assert ledger.buckets("A") == [Bucket(float(int(field) // CAP_CLASSES), 5, caps)]
    assert abs(ledger.admit("A", "s1", "r1", "w", 5, 100).expected_in_flight - caps) <= 1
