"""The selective-handoff study: per request, the mapped cache or the target's own prefill (stage `selective`).

Inputs: metrics/selective.json (per map: the ungated quality, per score its AUROC for "the map changes the
decision" and the dev-chosen threshold's row on the eval part, the per-request times and multiply-adds) and
eval/selective/curves.parquet (quality at each fallback rate, per map and score, with the oracle and random
gates). The figure: retention against the fallback rate, and against the effective speedup bound at the bound
pair's shapes, one row of panels per map.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.measure.gating import effective_speedup
from pipeline.store import paths
from pipeline.store.lazy import lazy
from pipeline.studies.format import md_table, pct, pct_interval, save_figure, subplots
from pipeline.studies.run import Run
from pipeline.studies.settings import ReportParams

pd = lazy("pandas")

CURVES = paths.SELECTIVE / "curves.parquet"


@dataclass
class Inputs:
    metrics: dict
    curves: pd.DataFrame


def load(run: Run) -> Inputs | None:
    """None when the stage did not run."""
    if not paths.SELECTIVE_METRICS.is_file():
        return None
    return Inputs(json.loads(paths.SELECTIVE_METRICS.read_text()), pd.read_parquet(CURVES))


def compute(params: ReportParams, inputs: Inputs) -> dict:
    """The stage's figures as they are, each map's best score (highest AUROC on the task items), and each curve
    point's effective speedup bound (the score's cost at the bound pair's shapes)."""
    maps = inputs.metrics["maps"]
    for facts in maps.values():
        facts["best"] = max(facts["scores"], key=lambda score: facts["scores"][score]["auroc_items"])
    curves = inputs.curves.copy()
    curves["speedup_bound"] = [  # the oracle and random references cost nothing to score
        effective_speedup(maps[name]["target"], maps[name]["handoff"], maps[name].get(score, 0), rate)
        for name, score, rate in zip(curves["map"], curves.score, curves.fallback_rate)]
    return {**inputs.metrics, "curves": curves.to_dict(orient="list")}


def lines(study: dict) -> list[str]:
    out = ["## Selective handoff: fall back to the target's prefill where the map is not trusted", "",
           f"Each request is scored from the handoff's first step (no target prefill of the prompt) and falls "
           f"back to the target's own prefill where its score exceeds a threshold, chosen on the dev items as "
           f"the highest reaching retention {pct(study['target_retention'])}, then applied once to the eval part. "
           f"AUROC: for \"the map changes the decision\" (task items: the chosen answer; prompts: the first "
           f"token). Speedups at {study['length']} prompt tokens: measured here, and bounded by multiply-adds at "
           f"{study['bound_pair']}'s shapes; a fallback pays the handoff, its score and the target's prefill.", ""]
    if "probe_l2" in study:
        out += [f"The `probe` score is a logistic regression per map (L2 {study['probe_l2']:g} on standardised "
                f"weights) on the first step's features (the other scores, the target's top-1 probability, the log "
                f"ratio of the mapped cache's mean key and value norms to the source cache's), trained on the dev "
                f"items only and judged on the eval part; its dev threshold is chosen on out-of-fold scores of the dev "
                f"items ({study['probe_folds']} folds), so not on the items each probe learned.", ""]
    rows = []
    for name, facts in study["maps"].items():
        rows.append([name, "none (ungated)", "—", "—", "—", "0%", pct(facts["retention"]), pct(facts["gap_closure"]),
                     pct(facts["next_token_top1"]), f"{facts['target_ms'] / facts['handoff_ms']:.2f}x",
                     f"{facts['target'] / facts['handoff']:.2f}x"])
        for score, row in facts["scores"].items():
            rows.append([name, score + (" (best)" if score == facts["best"] else ""), f"{row['auroc_items']:.3f}",
                         f"{row['auroc_prompts']:.3f}", f"{row['threshold']:.4g}",
                         pct_interval(row["fallback_rate"], row["fallback_rate_low"], row["fallback_rate_high"]),
                         pct_interval(row["retention"], row["retention_low"], row["retention_high"]),
                         pct_interval(row["gap_closure"], row["gap_closure_low"], row["gap_closure_high"]),
                         pct_interval(row["next_token_top1"], row["next_token_top1_low"], row["next_token_top1_high"]),
                         f"{row['speedup']:.2f}x", f"{row['speedup_bound']:.2f}x"])
    out += md_table(["Map", "Score", "AUROC items", "AUROC prompts", "Threshold", "Fallback (eval items)",
                     "Retention", "Gap closure", "Next-token top-1", "Speedup measured", "Speedup bound"], rows)
    out += ["", "![quality against fallback rate and effective speedup](report/selective.png)", ""]
    return out


def figure(study: dict, folder: Path) -> dict[str, pd.DataFrame]:
    """Per map: retention of the eval items against the fallback rate and against the effective speedup bound,
    one line per score, the oracle gate and the random one dashed."""
    curves = pd.DataFrame(study["curves"])
    items = curves[curves.requests == "items"]
    maps = list(study["maps"])
    fig, axes = subplots(len(maps), 2, figsize=(10, 3.5 * len(maps)), squeeze=False)
    for row, name in enumerate(maps):
        for score, part in items[items["map"] == name].groupby("score", sort=False):
            style = "--" if score in ("oracle", "random") else "-"
            axes[row][0].plot(part.fallback_rate, part.retention, style, marker=".", label=score)
            axes[row][1].plot(part.speedup_bound, part.retention, style, marker=".", label=score)
        axes[row][0].set_xlabel("fallback rate (eval items)")
        axes[row][1].set_xlabel(f"effective speedup bound ({study['bound_pair']}, {study['length']} tokens)")
        for ax in axes[row]:
            ax.set_ylabel(f"retention ({name})")
        axes[row][0].legend(fontsize=7)
    fig.suptitle("Selective handoff")
    save_figure(fig, folder / "selective.png")
    return {"selective": curves}
