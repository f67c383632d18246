"""What the commands print: shared by `datagen` subcommands and the demo, importing neither."""

from __future__ import annotations

import json
from typing import Any

from config.settings import Settings
from datagen.generation.ledger import Ledger
from datagen.generation.merge import datasets_on_disk, merge_dataset
from datagen.operations import dead as dead_mod
from datagen.operations import status as status_mod


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def render_produce(reports: list[Any]) -> str:
    """The produce table; ``window``: prompts not sent because train_max_length leaves them
    too little room (cap_to_window), ``trains``: the share of the enqueued max_new_tokens
    inside the window."""
    lines = [f"{'dataset':<14} {'read':>6} {'enqueued':>8} {'short':>6} {'long':>5} "
             f"{'done':>6} {'queued':>6} {'clamped':>7} {'skipped':>7} {'window':>6} "
             f"{'trains':>6}"]
    for r in reports:
        trains = "-" if r.trains is None else f"{100 * r.trains:.0f}%"
        lines.append(f"{r.dataset:<14} {r.read:>6} {r.enqueued:>8} {r.short:>6} {r.long:>5} "
                     f"{r.already_done:>6} {r.already_queued:>6} {r.clamped:>7} "
                     f"{r.bad_count:>7} {len(r.window):>6} {trains:>6}")
    for r in reports:
        if getattr(r, "conversations", 0):
            lines.append(f"{r.dataset}: {r.read} samples from {r.conversations} conversations "
                         "(regenerate = 'each': one per assistant turn)")
        for line in (r.rebuilt, r.skipped):
            if line:
                lines.append(line)
        if getattr(r, "window_drop", 0) or getattr(r, "window_cut", 0):
            lines.append(f"{r.dataset}: train_max_length will drop {r.window_drop} of the "
                         f"samples enqueued (the prompt fills it) and may cut {r.window_cut} "
                         "(prompt + max_new_tokens past it); cap_to_window is off")
        lines += _skips(r.dataset, r.bad) + _skips(r.dataset, r.window)
    total_bad = sum(r.bad_count for r in reports)
    lines.append(f"{sum(r.enqueued for r in reports)} enqueued, {total_bad} skipped as bad input, "
                 f"{sum(len(r.window) for r in reports)} for the window")
    return "\n".join(lines)


def _skips(dataset: str, reasons: list[str]) -> list[str]:
    lines = [f"  skipped {why}" for why in reasons[:10]]
    if len(reasons) > 10:
        lines.append(f"  ... {len(reasons) - 10} more in reports/{dataset}.bad.txt")
    return lines


def print_summary(ledger: Ledger, table: list[status_mod.Row]) -> None:
    """The end-of-run table, and why samples died when any did."""
    print(status_mod.render(table))
    reasons = dead_mod.summary(dead_mod.read(ledger, [r.dataset for r in table]))
    if reasons:
        print(reasons)


def merge_all(settings: Settings, ledger: Ledger, include_uncommitted: bool = False) -> None:
    for dataset in datasets_on_disk(settings.output_dir):
        committed = ledger.committed_index(dataset)
        report = merge_dataset(settings.output_dir, dataset, committed, include_uncommitted)
        extra = f", {report.duplicates} duplicates dropped" if report.duplicates else ""
        if report.uncommitted:
            extra += f", {report.uncommitted} uncommitted left out"
        print(f"{dataset}: {report.records} records, {report.completion_tokens:,} completion "
              f"tokens -> {report.path}{extra}")
