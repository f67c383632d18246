"""The status table's figures, read from a real ledger."""

from __future__ import annotations

import time

from config.settings import Settings
from datagen import status
from datagen.generation.ledger import Ledger, connect


def test_eta_is_whichever_ends_first_the_budget_or_the_samples(redis_url: str) -> None:
    # Given: a dataset with a large budget left, 3 samples of 100 tokens done and 5 queued
    led = Ledger(connect(redis_url), Settings(redis_url=redis_url, token_budget=10**7))
    led.register(["A"])
    led.mark_run()
    for i in range(3):
        led.admit("A", f"s{i}", f"r{i}", "w", 1, 400)
        led.commit("A", f"s{i}", f"r{i}", 1, 100, False, 1.0)
        time.sleep(0.2)
    led.add_pending("A", {f"q{i}": "{}" for i in range(5)})
    row = next(r for r in status.rows(led) if r.dataset == "A")
    # Then: the ETA is that of the 5 samples (~500 tokens), not of the ~10M tokens of budget
    assert row.tokens_per_s and row.eta_s is not None
    assert row.eta_s == 500 / row.tokens_per_s
    assert row.eta_s < row.remaining / row.tokens_per_s / 1000
    assert row.queued == 5 and row.waiting == 0 and row.state == "queued"
