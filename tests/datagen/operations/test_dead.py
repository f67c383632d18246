"""Dead letters grouped by reason, against a real Redis ledger."""

from __future__ import annotations

import pytest

from config.settings import Settings
from datagen.generation.ledger import Ledger, connect
from datagen.operations import dead

TOO_LONG = "The input ({n} tokens) is longer than the model's context length (400 tokens)."
UNAVAILABLE = ("server unavailable after 4 tries: HTTP 503: rid 9f3a2b1c0d4e5f60 "
               "at http://127.0.0.1:{port}")
TRUNCATED = "truncated at max_new_tokens and keep_truncated is off"


def test_reasons_that_differ_only_in_numbers_make_one_group_most_frequent_first() -> None:
    # Given: three prompts too long by different amounts, two outages, one truncation
    reasons = {"s3": TOO_LONG.format(n=512), "s1": TOO_LONG.format(n=700),
               "s2": TOO_LONG.format(n=401), "s5": UNAVAILABLE.format(port=30001),
               "s4": UNAVAILABLE.format(port=30002), "s6": TRUNCATED}

    groups = dead.group(reasons)

    assert [(g.reason, g.count) for g in groups] == [
        ("The input (N tokens) is longer than the model's context length (N tokens).", 3),
        ("server unavailable after N tries: HTTP N: rid <id> at http://N.N.N.N:N", 2),
        (TRUNCATED, 1)]
    assert groups[0].samples == ("s1", "s2", "s3")  # sorted, and the example is the first's
    assert groups[0].example == TOO_LONG.format(n=700)
    assert groups[1].samples == ("s4", "s5")
    assert dead.group({}) == ()


def test_ties_are_ordered_by_reason() -> None:
    groups = dead.group({"a": "zeta failed", "b": "alpha failed"})
    assert [g.reason for g in groups] == ["alpha failed", "zeta failed"]


@pytest.fixture
def ledger(redis_url: str) -> Ledger:
    led = Ledger(connect(redis_url), Settings(redis_url=redis_url, token_budget=1000))
    led.register(["A", "B", "C"])
    for sample, n in (("a1", 500), ("a2", 600)):
        led.dead_letter("A", sample, TOO_LONG.format(n=n))
    led.dead_letter("A", "a3", TRUNCATED)
    led.dead_letter("B", "b1", TRUNCATED)
    return led


def test_the_listing_reads_every_dataset_or_the_one_named(ledger: Ledger) -> None:
    table = dead.read(ledger)
    assert [(d.dataset, d.count) for d in table] == [("A", 3), ("B", 1), ("C", 0)]
    assert [d.dataset for d in dead.read(ledger, ["B"])] == ["B"]
    with pytest.raises(ValueError, match="unknown dataset 'Z'"):
        dead.read(ledger, ["Z"])
    rows = dead.as_json(table)
    assert rows[0]["reasons"][0] == {
        "reason": "The input (N tokens) is longer than the model's context length (N tokens).",
        "count": 2, "example": TOO_LONG.format(n=500), "samples": ["a1", "a2"]}
    assert rows[2] == {"dataset": "C", "dead": 0, "reasons": []}
    text = dead.render(table)
    assert "A: 3 dead" in text and "C: none dead" in text and "a1, a2" in text
    # each group is shown by a real reason, never by its masked key
    assert f"       2  e.g. {TOO_LONG.format(n=500)}" in text.splitlines()
    assert f"       1  {TRUNCATED}" in text.splitlines()
    assert "(N tokens)" not in text


def test_the_run_summary_shows_the_top_reasons_and_nothing_when_none_died(
        ledger: Ledger) -> None:
    lines = dead.summary(dead.read(ledger), n=2).splitlines()
    assert lines[0].startswith("dead letters: 4 samples")
    assert lines[1] == f"       2  A  e.g. {TOO_LONG.format(n=500)}"  # a real reason, not "N"
    assert lines[2].split()[:2] == ["1", "A"]  # ties: by dataset, then reason
    assert lines[3] == "  ... and 1 more reasons"
    assert dead.summary(dead.read(ledger, ["C"])) == ""
