"""Progress output: a bar with rate and ETA on a terminal, quiet log lines elsewhere."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import pytest

from datagen.operations import progress as progress_mod
from datagen.operations.progress import Progress, count_lines


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_the_bar_is_redrawn_with_rate_and_eta(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.setattr(progress_mod, "DRAW_EVERY_S", 0.0)
    out = Terminal()
    bar = Progress("produce B1", total=200, unit="prompts", stream=out)
    bar.update(50)
    bar.update(50)
    bar.close()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # colours, cursor
    assert text.count("\r") >= 2 and text.endswith("\n")  # redrawn in place, ends a line
    assert re.search(r" 50/200 prompts +25%", text) and re.search(r"100/200 prompts +50%", text)
    assert "ETA" in text and "prompts/s" in text


def test_off_a_terminal_it_logs_lines_and_draws_nothing(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    monkeypatch.setattr(progress_mod, "LOG_EVERY_S", 0.0)
    out = io.StringIO()
    with caplog.at_level(logging.INFO, logger="datagen.operations.progress"):
        bar = Progress("extract", total=10, unit="shards", stream=out)
        bar.update(4)
        bar.close()
    assert out.getvalue() == ""
    assert any("extract [" in r.message and "4/10 shards" in r.message for r in caplog.records)


def test_count_lines(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text("1\n2\n3\n")
    (tmp_path / "b.jsonl").write_text("4\n")
    assert count_lines([tmp_path / "a.jsonl", tmp_path / "b.jsonl"]) == 4
