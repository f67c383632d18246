"""The status table's figures, read from a real ledger."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

from cli.stack import REPO
from config.settings import Settings
from datagen.generation.ledger import Ledger, connect
from datagen.operations import status


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


def _row(name: str, state: str, tokens: int, budget: int, **kw: object) -> status.Row:
    base = dict(dataset=name, state=state, budget=budget, tokens=tokens,
                remaining=max(0, budget - tokens), percent=100.0 * tokens / budget,
                samples=3_000, queued=2_400, waiting=3, in_flight=150, dead=2, revoked=240,
                truncated=0, tokens_per_s=12_345.0, eta_s=470.0)
    return status.Row(**{**base, **kw})


TABLE = [_row("A1_code", "running", 4_210_333, 10_000_000),
         _row("A2_longdoc", "closed at budget", 10_004_000, 10_000_000, in_flight=0),
         _row("B1_chat", "waiting", 1_000, 137_500_000, tokens_per_s=None, eta_s=None)]


def test_the_table_fits_the_terminal_and_drops_optional_columns_first() -> None:
    wide = status.render(TABLE, columns=200)
    assert wide.splitlines()[0].split() == [
        "dataset", "state", "tokens", "budget", "generated", "remaining", "%", "samples",
        "queued", "wait", "flight", "dead", "revoked", "tok/s", "eta"]
    for columns in (100, 80):
        text = status.render(TABLE, columns=columns)
        assert max(map(len, text.splitlines())) <= columns, text
        head = text.splitlines()[0].split()
        # what a run is about stays, in full: no number is cut
        assert head[:4] == ["dataset", "state", "tokens", "budget"] and "samples" in head
        assert "137,500,000" in text and "closed at budget" in text and "total" in text
        assert "…" not in text
    assert "remaining" not in status.render(TABLE, columns=100)
    # the default away from a terminal (logs, pipes) is 100 columns
    assert max(map(len, status.render(TABLE).splitlines())) <= 100


def test_the_live_table_keeps_a_progress_bar_per_dataset() -> None:
    text = status.render(TABLE, bars=True, columns=100)
    assert max(map(len, text.splitlines())) <= 100
    assert "####......  42.1%" in text and "########## 100.0%" in text


def test_status_watch_redraws_the_table_in_place_on_a_terminal(redis_url: str) -> None:
    # Given: a ledger with one dataset, and `datagen status --watch` on a pseudo-terminal
    led = Ledger(connect(redis_url), Settings(redis_url=redis_url, token_budget=5_000))
    led.register(["W1"])
    led.mark_run()
    main_fd, child_fd = pty.openpty()
    env = dict(os.environ, COLUMNS="100", LINES="40", TERM="xterm")
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "status", "--watch",
                             "--interval", "0.2", "--redis-url", redis_url],
                            cwd=REPO, env=env, stdin=child_fd, stdout=child_fd,
                            stderr=subprocess.DEVNULL, close_fds=True)
    os.close(child_fd)
    seen = b""
    try:
        # When: it has drawn the table at least three times
        while seen.count(b"total") < 3:
            ready, _, _ = select.select([main_fd], [], [], 60)
            assert ready, f"no redraw within 60 s: {seen[-500:]!r}"
            seen += os.read(main_fd, 65536)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        os.close(main_fd)
    # Then: each redraw moves the cursor back up over the last one (no scrolling copies)
    text = seen.decode(errors="replace")
    assert "W1" in text and "5,000" in text
    assert "\x1b[1A" in text or "\x1b[2K" in text
    assert max(len(line) for line in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
               .splitlines()) <= 100
