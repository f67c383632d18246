"""The progress picture drawn from records on disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from config.settings import Settings
from datagen.generation.ledger import Ledger, connect
from datagen.generation.records import records_dir
from datagen.operations.plot import load_series, plot_run, run_budgets
from datagen.redis_server import free_port

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_records(output_dir: Path, dataset: str, writer: str,
                  rows: list[tuple[str, float, int]]) -> None:
    folder = records_dir(output_dir, dataset)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{writer}.jsonl", "a", encoding="utf-8") as fh:
        for sample, when, tokens in rows:
            fh.write(json.dumps({"id": sample, "dataset": dataset, "rid": f"r-{sample}-{when}",
                                 "prompt_tokens": 10, "completion_tokens": tokens,
                                 "time": when}) + "\n")


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    # Given A written by two workers, with s2 delivered twice, and B still far from budget.
    out = tmp_path / "out"
    write_records(out, "A", "h1-1", [("s1", 100.0, 400), ("s2", 103.0, 300)])
    write_records(out, "A", "h2-7", [("s3", 101.5, 350), ("s2", 104.0, 280)])
    write_records(out, "B", "h1-1", [("b1", 102.0, 120), ("b2", 106.0, 90)])
    with open(records_dir(out, "B") / "h1-1.jsonl", "a", encoding="utf-8") as fh:
        fh.write('{"id": "torn", "dat')  # a writer killed mid-line
    return out


def test_series_count_each_sample_once_in_time_order(run_dir: Path) -> None:
    series = {s.dataset: s for s in load_series(run_dir)}
    assert series["A"].times == [100.0, 101.5, 103.0]
    assert series["A"].tokens == [400, 750, 1050]
    assert series["B"].tokens == [120, 210]
    total = {s.dataset: s.tokens[-1] for s in load_series(run_dir, measure="total")}
    assert total == {"A": 1080, "B": 230}


def test_series_count_trainable_tokens_with_the_generated_total_beside(run_dir: Path) -> None:
    # the records hold no trainable count: each counts its output up to the window (100 - 10)
    series = {s.dataset: s for s in load_series(run_dir, measure="trainable", window=100)}
    assert series["A"].tokens == [90, 180, 270] and series["A"].generated == 1050
    assert series["B"].tokens == [90, 180] and series["B"].generated == 210


def test_plot_writes_a_png(run_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = plot_run(run_dir, {"A": 1000, "B": 100_000}, tmp_path / "pics" / "progress.png")
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert 10_000 < len(data) < 1_000_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1200, 500)


def test_plot_refuses_a_folder_without_records(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no records"):
        plot_run(tmp_path, {}, tmp_path / "empty.png")


def test_budgets_come_from_the_ledger_else_from_the_settings(redis_url: str) -> None:
    settings = Settings(redis_url=redis_url, token_budget=1000, budgets={"B": 50})
    Ledger(connect(redis_url), settings).set_budget("A", 7000)  # a live `datagen budget`
    assert run_budgets(settings, ["A", "B"]) == {"A": 7000, "B": 50}
    gone = settings.replace(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    assert run_budgets(gone, ["A", "B"]) == {"A": 1000, "B": 50}
