"""The ledger's Lua steps against a real Redis, and the length model they rely on."""

from __future__ import annotations

import math
import random
import time

import pytest

from config.settings import Settings
from datagen import status
from datagen.celery_app import make_app
from datagen.generation import guard
from datagen.generation.ledger import Ledger, connect, length_model


@pytest.fixture
def ledger(redis_url: str) -> Ledger:
    led = Ledger(connect(redis_url), Settings(redis_url=redis_url, token_budget=1000))
    led.register(["A"])
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
    assert ledger.admit("A", "s1", "r2", "w", 5, 100).status == "busy"
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
    led.admit("A", "s1", "r1", "w", 40, 100)
    led.commit("A", "s1", "r1", 40, 60, False, 1.0)
    assert led.snapshot("A")["tokens"] == 100


def test_max_samples_closes_the_dataset(redis_url: str) -> None:
    led = Ledger(connect(redis_url), Settings(redis_url=redis_url, max_samples=2))
    led.register(["A"])
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
