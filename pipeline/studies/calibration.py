"""The calibration curve: candidates refitted on the first n sequences of the calibration pool (stage
`calibrate@<n>`), their retention and gap closure against n, and from which n the larger k pays off."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.measure.retention import paired_items
from pipeline.measure.settings import MeasureParams
from pipeline.measure.stats import paired_bootstrap
from pipeline.store import paths
from pipeline.store.artifacts import read_table
from pipeline.store.lazy import lazy
from pipeline.studies.format import interval, md_table, pct_ci, save_figure, subplots
from pipeline.studies.run import Run, quality
from pipeline.studies.settings import ReportParams

np = lazy("numpy")
pd = lazy("pandas")

COLUMNS = ["sequences", "tokens", "candidate", "retention", "retention_low", "retention_high", "gap_closure",
           "gap_closure_low", "gap_closure_high", "params_per_token"]  # a row of the curve (plots/calibration.csv)


@dataclass
class Inputs:
    items: dict[str, pd.DataFrame]  # the variants' per-item rows (the oracle's and the source's are read)
    points: dict[int, dict]  # per size n: tokens and each candidate's parameters per token
    point_items: dict[int, dict[str, pd.DataFrame]]  # per size n, per candidate: its eval-part items


def load(run: Run) -> Inputs | None:
    """The sizes `calibration.sizes` declares (none ran: an empty study); None without the source's items."""
    points = {size: json.loads(path.read_text()) for size, path in paths.calibration_points().items()}
    points = {size: point for size, point in points.items() if size in run.calibration_sizes}
    if not points:
        return Inputs(run.items, {}, {})
    if "source" not in run.items:
        return None
    return Inputs(run.items, points, {size: {path.stem: read_table(path)
                                             for path in sorted(paths.calibration_items(size).glob("*.parquet"))}
                                      for size in points})


def compute(params: ReportParams, measure: MeasureParams, inputs: Inputs) -> dict:
    """Per size and candidate: retention and gap closure. Per size: task accuracy of the largest-k linear candidate
    minus the smallest-k one, and `larger_k_pays_from`, the smallest size from which its low end stays above 0."""
    points, point_items, rows = inputs.points, inputs.point_items, []
    for size in sorted(points):
        for name, frame in point_items[size].items():
            rows.append({"sequences": size, "tokens": points[size]["tokens"], "candidate": name,
                         **quality({**inputs.items, name: frame}, name, params, measure),
                         "params_per_token": points[size]["maps"][name]["params_per_token"]})
    maps = {name: fit for size in sorted(points) for name, fit in points[size]["maps"].items()}
    linear = sorted((name for name in maps if maps[name]["family"] == "linear" and not maps[name].get("distilled")),
                    key=lambda name: maps[name]["k"])  # the closed-form maps' larger-k question
    larger = {}
    if len(linear) >= 2:
        small, big = linear[0], linear[-1]
        for size in sorted(points):
            x, y = paired_items(point_items[size], big, small, "acc")
            larger[size] = paired_bootstrap(x, y, *measure.bootstrap)
    pays = [size for size in larger if all(larger[s]["low"] > 0 for s in larger if s >= size)]
    return {"rows": rows, "larger_k": {"larger": linear[-1], "smaller": linear[0], "by_size": larger}
            if larger else None, "larger_k_pays_from": min(pays) if pays else None}


def shown(study: dict) -> dict:
    larger = study["larger_k"]
    return {"sizes": sorted({row["sequences"] for row in study["rows"]}),
            "table": md_table(["Sequences", "Tokens", "Candidate", "Parameters per token", "Retention [95% CI]",
                               "Gap closure [95% CI]"],
                              [[r["sequences"], f"{r['tokens']:,}", r["candidate"], f"{r['params_per_token']:.3g}",
                                pct_ci(r, "retention"), pct_ci(r, "gap_closure")]
                               for r in study["rows"]]),
            "larger": md_table(["Sequences", "Δ [95% CI]", "n"],
                               [[size, interval(c["diff"], c["low"], c["high"]), c["n"]]
                                for size, c in larger["by_size"].items()]) if larger else None}


def figure(study: dict, folder: Path) -> dict[str, pd.DataFrame]:
    table = pd.DataFrame(study["rows"], columns=COLUMNS)
    fig, axes = subplots(1, 2, figsize=(10, 4), sharex=True)
    for ax, column in ((axes[0], "retention"), (axes[1], "gap_closure")):
        if table.empty:
            ax.text(0.5, 0.5, "no calibration point in this profile (calibration.sizes)", ha="center", va="center")
            ax.set_axis_off()
            continue
        for name, group in table.groupby("candidate", sort=False):
            y = group[column].to_numpy()
            errors = np.vstack([y - group[f"{column}_low"].to_numpy(), group[f"{column}_high"].to_numpy() - y])
            ax.errorbar(group.tokens, y, yerr=np.nan_to_num(errors), marker="o", capsize=3, label=name)
        ax.set_xscale("log")
        ax.set_xlabel("calibration tokens")
        ax.set_ylabel(column.replace("_", " ") + " (eval part)")
    if not table.empty:
        axes[0].legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, folder / "calibration.png")
    return {"calibration": table}
