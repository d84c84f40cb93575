"""How the studies write numbers, tables and figures: percentages, intervals, Markdown tables, PNG files."""
from __future__ import annotations

from pathlib import Path

from pipeline.store.artifacts import atomic_path
from pipeline.store.lazy import lazy

matplotlib = lazy("matplotlib")
plt = lazy("matplotlib.pyplot")


def pct(x: float | None) -> str:
    return "n/a" if x is None or x != x else f"{100 * x:.1f}%"


def interval(value: float, low: float, high: float, scale: float = 100, fmt: str = "+.1f") -> str:
    return f"{scale * value:{fmt}} [{scale * low:{fmt}}, {scale * high:{fmt}}]"


def pct_interval(value: float | None, low: float | None, high: float | None) -> str:
    return f"{pct(value)} [{pct(low)}, {pct(high)}]"


def pct_ci(row: dict, key: str) -> str:
    return pct_interval(row[key], row[f"{key}_low"], row[f"{key}_high"])


def pct_ci_n(row: dict, key: str, count: int) -> str:
    return f"{'n/a' if row[key] is None else pct_ci(row, key)} (n = {count})"


def pct_or_dash(x: float | None) -> str:
    return "—" if x is None else pct(x)


def times(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def and_(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def md_table(header: list[str], rows: list[list[object]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)])


def subplots(*args, **kwargs):
    """On Agg, chosen here: matplotlib loads at the first figure."""
    matplotlib.use("Agg")
    return plt.subplots(*args, **kwargs)


def save_figure(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
