"""How benchmark results are shown: fixed-width text tables and grouped-bar PNGs (matplotlib, Agg).

Both take plain numbers; `None` is a cell that was not measured ("-" in a table, no bar in a chart).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | str | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return f"{value:,.{digits}f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned first column, right-aligned others, one space-padded line per row."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        first = str(cells[0]).ljust(widths[0])
        rest = [str(c).rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest])

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


@dataclass(frozen=True)
class BarPanel:
    """One chart: `series[name][i]` is the bar of series `name` in category `categories[i]`."""

    title: str
    ylabel: str
    categories: Sequence[str]
    series: Mapping[str, Sequence[float | None]]
    reference: tuple[float, str] | None = None  # a horizontal line (value, label), e.g. a target


def write_bar_chart(path: str | Path, title: str, panels: Sequence[BarPanel], *,
                    columns: int = 3) -> Path:
    """Grouped bars, one subplot per panel, written as a PNG; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(columns, len(panels))
    num_rows = (len(panels) + columns - 1) // columns
    fig, axes = plt.subplots(num_rows, columns, figsize=(5.2 * columns, 3.8 * num_rows),
                             squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        num_series = max(len(panel.series), 1)
        width = 0.8 / num_series
        for k, (name, values) in enumerate(panel.series.items()):
            xs = [i + (k - (num_series - 1) / 2) * width for i in range(len(panel.categories))]
            heights = [v if v is not None else 0.0 for v in values]
            bars = ax.bar(xs, heights, width, label=name)
            for bar, v in zip(bars, values, strict=True):
                if v is not None:
                    ax.annotate(f"{v:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=7)
        if panel.reference is not None:
            ax.axhline(panel.reference[0], color="black", linestyle="--", linewidth=1,
                       label=panel.reference[1])
        ax.set_xticks(range(len(panel.categories)), list(panel.categories), fontsize=8)
        ax.set_title(panel.title, fontsize=10)
        ax.set_ylabel(panel.ylabel, fontsize=9)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
