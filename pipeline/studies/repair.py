"""The repair study (stage `repair`): mapped caches partly recomputed by the target, quality against budget, beside
the baselines at the same budget: the truncated prompt, speculative prefill and the source alone (budget 0)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.measure.prompt_metrics import PROMPT_METRICS
from pipeline.measure.retention import closure_interval
from pipeline.measure.settings import MeasureParams
from pipeline.measure.stats import pareto_front
from pipeline.store import paths
from pipeline.store.artifacts import ArtifactError, read_table
from pipeline.store.lazy import lazy
from pipeline.studies.format import md_table, pct, pct_ci, pct_or_dash, save_figure, subplots, times
from pipeline.studies.run import Run, quality
from pipeline.studies.settings import ReportParams

np = lazy("numpy")
pd = lazy("pandas")

SOURCE = "source alone"  # the source model alone (stage evaluate's `source`): no target prefill at all, budget 0
# the baselines stage repair runs at each budget level (their settings are the levels), by the report's policy names
AT_LEVELS = {paths.TRUNCATED_BASELINE: "truncated prompt", paths.SPECULATIVE_BASELINE: "speculative prefill"}
MATCHED_BASELINES = (*AT_LEVELS, SOURCE)
JOINS = "candidates"  # the study whose result `join` reads (studies.run.Joining)


@dataclass
class Inputs:
    items: dict[str, pd.DataFrame]  # the variants' per-item rows (the oracle's and the source's are read)
    metrics: dict
    rows: dict[tuple[str, str], pd.DataFrame]  # (map or a baseline of AT_LEVELS, setting or budget) -> item rows
    source: dict  # the source alone's figures (metrics/eval/source.json)


def load(run: Run) -> Inputs | None:
    if not paths.REPAIR_METRICS.is_file() or not {"oracle", "source"} <= set(run.items):
        return None
    metrics = json.loads(paths.REPAIR_METRICS.read_text())
    if any("policy" not in figures for settings in metrics["maps"].values() for figures in settings.values()):
        raise ArtifactError(f"{paths.REPAIR_METRICS}: written before each setting recorded its policy; rerun the "
                            "repair stage (dvc repro repair)")
    rows = {(name, setting): read_table(paths.repair_rows("items", name, setting))
            for name, settings in metrics["maps"].items() for setting in settings}
    rows.update({(name, budget): read_table(paths.repair_rows("items", name, budget))
                 for name in AT_LEVELS for budget in metrics.get(name, {})})
    return Inputs(run.items, metrics, rows, run.metrics["source"])


def compute(params: ReportParams, measure: MeasureParams, inputs: Inputs) -> dict:
    """Per map and setting (each baseline of AT_LEVELS: per budget level) its quality, and against the map's `none`."""
    rows = []
    for (name, setting), frame in inputs.rows.items():
        key = f"{name}@{setting}"
        level = name in AT_LEVELS
        figures = inputs.metrics[name][setting] if level else inputs.metrics["maps"][name][setting]
        budget = float(setting) if level else figures["budget"]
        row = {"map": name, "setting": setting, "budget": budget,
               "policy": AT_LEVELS[name] if level else figures["policy"],
               **quality({**inputs.items, key: frame}, key, params, measure),
               **prompt_metrics(figures), **{k: figures.get(k) for k in ("bound", "speedup")}}
        if not level:
            unrepaired = {**inputs.items, key: frame, "oracle": inputs.rows[(name, "none")]}
            against = closure_interval(unrepaired, key, params.retention_metric, *measure.bootstrap)
            row.update({"vs_none": against["retention"], "vs_none_low": against["low"],
                        "vs_none_high": against["high"]})
        rows.append(row)
    rows.append(source_row(params, measure, inputs))
    rows.sort(key=lambda row: (row["map"] in MATCHED_BASELINES, row["map"], row["budget"]))
    return {"rows": rows, "length": inputs.metrics["length"], "bound_pair": inputs.metrics["bound_pair"]}


def source_row(params: ReportParams, measure: MeasureParams, inputs: Inputs) -> dict:
    """The source model alone: budget 0 (the target computes nothing)."""
    return {"map": SOURCE, "setting": "—", "budget": 0.0, "policy": SOURCE,
            **quality(inputs.items, "source", params, measure), "bound": None, "speedup": None,
            **prompt_metrics(inputs.source)}


def prompt_metrics(figures: dict) -> dict:
    return {name: figures["prompts"].get(name) for name in PROMPT_METRICS}


def join(study: dict, candidates: dict | None) -> None:
    """The Pareto front of gap closure against the FLOP bound over the candidates and the repaired points; unset
    unless both count at the same pair and length."""
    if not candidates or (candidates["bound_pair"], candidates["length"]) != (study["bound_pair"], study["length"]):
        return
    repaired = [row for row in study["rows"] if row["map"] not in MATCHED_BASELINES and row["setting"] != "none"]
    points = [(name, row["gap_closure"], row["bound_at_pair"]) for name, row in candidates["rows"].items()]
    points += [(f"{row['map']}@{row['setting']}", row["gap_closure"], row["bound"]) for row in repaired]
    on = pareto_front([closure for _, closure, _ in points], [bound for _, _, bound in points])
    names = [name for (name, _, _), on_front in zip(points, on) if on_front]
    for row in repaired:
        row["front"] = f"{row['map']}@{row['setting']}" in names
    study["front"] = names
    study["front_gains"] = [name for name in names if "@" in name]


def cheapest(rows: list[dict]) -> list[tuple[str, dict | None]]:
    """Per map: the cheapest setting whose retention interval reaches 100% (the oracle), or None where none does."""
    out = []
    for name in maps(rows):
        reaching = [row for row in rows if row["map"] == name and row["retention_high"] >= 1.0]
        out.append((name, min(reaching, key=lambda row: row["budget"]) if reaching else None))
    return out


def maps(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(row["map"] for row in rows if row["map"] not in MATCHED_BASELINES))


def levels(rows: list[dict]) -> list[dict]:
    """Per budget level (the truncated prompt's grid): both baselines' rows there and each map's `best` repair."""
    truncated = {round(row["budget"], 3): row for row in rows if row["map"] == paths.TRUNCATED_BASELINE}
    speculative = {round(row["budget"], 3): row for row in rows if row["map"] == paths.SPECULATIVE_BASELINE}
    out = []
    for level, base in sorted(truncated.items()):
        best = {}
        for name in maps(rows):
            same = [r for r in rows if r["map"] == name and r["setting"] != "none" and round(r["budget"], 3) == level]
            if same:
                best[name] = max(same, key=lambda row: row["retention"])
        out.append({"budget": level, "truncated": base, "speculative": speculative.get(level), "best": best})
    return out


def shown(study: dict) -> dict:
    rows = study["rows"]
    return {"table": md_table(
        ["Map", "Setting", "Budget", "Policy", "Top-1", "Rollout", "Retention [95% CI]", "Gap closure [95% CI]",
         "vs none [95% CI]", "Bound", "Measured", "Front", "Confident top-1",
         "Oracle-weighted agreement"],
        [[r["map"], r["setting"], pct(r["budget"]), r["policy"], pct_or_dash(r["next_token_top1"]),
          pct_or_dash(r["rollout_agreement"]), pct_ci(r, "retention"), pct_ci(r, "gap_closure"),
          pct_ci(r, "vs_none") if "vs_none" in r else "—", times(r["bound"]),
          times(r["speedup"]), {True: "at pair", False: "—", None: ""}[r.get("front")],
          pct_or_dash(r["confident_top1"]), pct_or_dash(r["oracle_weighted_agreement"])] for r in rows]),
        "levels": levels(rows), "cheapest": cheapest(rows)}


def figure(study: dict, folder: Path) -> dict[str, pd.DataFrame]:
    table = pd.DataFrame(study["rows"])
    names = maps(study["rows"])
    fig, axes = subplots(1, max(len(names), 1), figsize=(5 * max(len(names), 1), 3.8), squeeze=False, sharey=True)
    levels = {label: table[table["map"] == name].sort_values("budget") for name, label in AT_LEVELS.items()}
    source = table[table["map"] == SOURCE].retention
    for ax, name in zip(axes[0], names):
        part = table[table["map"] == name]
        none = part[part.setting == "none"]
        for label, group in part[part.setting != "none"].groupby("policy", sort=True):
            group = pd.concat([none, group]).sort_values("budget")
            ax.plot(group.budget, group.retention, marker="o", label=label)
        for (label, baseline), style in zip(levels.items(), ("k--", "k-.")):
            if len(baseline):
                ax.plot(baseline.budget, baseline.retention, style, marker="x", label=label)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(float(source.iloc[0]), color="black", ls=":", lw=0.8, label="source alone")
        ax.set_xlabel(f"budget (share of target prefill, {study['bound_pair']})")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("retention (eval items)")
    fig.tight_layout()
    save_figure(fig, folder / "repair.png")
    return {"repair": table}
