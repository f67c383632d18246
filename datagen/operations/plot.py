"""The README picture: committed tokens per dataset over time, against each budget.

The curves come from the records on disk, not the ledger, so any run folder can be drawn,
finished or not, with or without its Redis; only the budgets are read from the ledger when
it answers. A sample stored twice (a redelivery) is counted once, at its earliest record,
as merge keeps it. matplotlib loads lazily with the Agg backend, so the
rest of the package never needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from config.settings import Settings
from datagen.generation.ledger import Ledger
from datagen.generation.merge import datasets_on_disk
from datagen.generation.records import canonical, counted_tokens, iter_records, records_dir

# A budget more than this many times the largest curve would flatten every curve to the
# axis; it is named in the legend instead of drawn.
BUDGET_OFF_SCALE = 3.0


@dataclass(frozen=True)
class Series:
    dataset: str
    times: list[float]  # wall-clock seconds, ascending
    tokens: list[int]  # cumulative counted tokens after each record
    generated: int = 0  # every token the counted records generated (beside the budget's unit)


def load_series(output_dir: str | Path, measure: str = "completion",
                window: int = 0) -> list[Series]:
    """Cumulative counted tokens per dataset, from the records under ``output_dir``;
    ``window``: train_max_length, for a "trainable" count of records without one."""
    out = []
    for dataset in datasets_on_disk(output_dir):
        chosen, _, _ = canonical(iter_records(records_dir(output_dir, dataset)))
        points = sorted((float(r["time"]), n, int(r.get("completion_tokens") or 0))
                        for r in chosen.values() if r.get("time") is not None
                        and (n := counted_tokens(r, measure, window)) is not None)
        total, times, tokens = 0, [], []
        for when, counted, _ in points:
            total += counted
            times.append(when)
            tokens.append(total)
        if times:
            out.append(Series(dataset, times, tokens, sum(p[2] for p in points)))
    return out


def run_budgets(settings: Settings, datasets: list[str]) -> dict[str, int]:
    """Each dataset's budget: the ledger's (it holds live `datagen budget` changes) when
    Redis answers, else the settings' (a finished demo's throwaway Redis is gone)."""
    try:
        ledger = Ledger.from_settings(settings)
        return {name: ledger.budget(name) for name in datasets}
    except redis.exceptions.RedisError:
        return {name: settings.budget_for(name) for name in datasets}


def plot_run(output_dir: str | Path, budgets: Mapping[str, int], out_png: str | Path,
             measure: str = "completion", title: str | None = None, window: int = 0) -> Path:
    """Draw every dataset's cumulative tokens with its budget dashed; write a PNG."""
    series = load_series(output_dir, measure, window)
    if not series:
        raise ValueError(f"no records with a time under {Path(output_dir) / 'records'}")
    import matplotlib  # noqa: PLC0415 (optional, heavy)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(12, 5), dpi=100)
    try:
        _draw(ax, series, budgets, measure)
        ax.set_title(title or f"Committed {measure} tokens per dataset, each against its budget")
        fig.tight_layout()
        out = Path(out_png)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out


def _draw(ax: Any, series: list[Series], budgets: Mapping[str, int], measure: str) -> None:
    import matplotlib  # noqa: PLC0415
    from matplotlib.lines import Line2D  # noqa: PLC0415
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415

    start = min(s.times[0] for s in series)
    span = max(s.times[-1] for s in series) - start
    scale, unit = _time_unit(span)
    top = max(s.tokens[-1] for s in series)
    drawn = [b for s in series if (b := budgets.get(s.dataset)) and b <= BUDGET_OFF_SCALE * top]
    ceiling = max([top, *drawn, 1])
    palette = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, s in enumerate(series):
        color = palette[i % len(palette)]
        x = [(s.times[0] - start) / scale] + [(t - start) / scale for t in s.times]
        y = [0] + s.tokens
        ax.step(x, y, where="post", color=color, linewidth=2,
                label=_label(s, budgets.get(s.dataset), ceiling))
        budget = budgets.get(s.dataset)
        if budget and budget <= ceiling:
            ax.axhline(budget, color=color, linestyle="--", linewidth=1.2, alpha=0.8)
    ax.set_xlim(left=0)
    ax.set_ylim(0, ceiling * 1.1)
    ax.set_xlabel(f"time since the first record ({unit})")
    ax.set_ylabel(f"committed {measure} tokens")
    ax.yaxis.set_major_formatter(FuncFormatter(_token_axis(ceiling)))
    ax.grid(True, alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    handles.append(Line2D([], [], color="grey", linestyle="--", label="budget"))
    # Beside the axes: a run has many datasets, and inside the legend would hide curves.
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9,
              frameon=False)


def _label(s: Series, budget: int | None, ceiling: float) -> str:
    generated = f", {s.generated:,} generated" if s.generated != s.tokens[-1] else ""
    if not budget:
        return f"{s.dataset}: {s.tokens[-1]:,}{generated}"
    note = "" if budget <= ceiling else ", off scale"
    return (f"{s.dataset}: {s.tokens[-1]:,} / {budget:,} budget "
            f"({100 * s.tokens[-1] / budget:.0f}%{note}){generated}")


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s > 3 * 3600:
        return 3600.0, "hours"
    if span_s > 180:
        return 60.0, "minutes"
    return 1.0, "seconds"


def _token_axis(ceiling: float) -> Any:
    """Tick labels in one unit for the whole axis (k or M once the numbers get long)."""
    for threshold, size, suffix in ((1e6, 1e6, "M"), (1e4, 1e3, "k")):
        if ceiling >= threshold:
            return lambda v, _: (f"{v / size:,.2f}".rstrip("0").rstrip(".") + suffix
                                 if v else "0")
    return lambda v, _: f"{v:,.0f}"
