"""The selective-handoff study (stage `selective`): per request, the mapped cache or the target's own prefill. A gate
is judged by each score's AUROC for "the map changes the decision" on the eval items and by the quality it keeps
against fallback rate and effective speedup bound: ungated, at each dev threshold, beside oracle and random gates."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.measure.gating import effective_speedup
from pipeline.measure.settings import MeasureParams
from pipeline.store import paths
from pipeline.store.artifacts import ArtifactError, read_table
from pipeline.store.lazy import lazy
from pipeline.studies.format import md_table, pct, pct_ci, pct_ci_n, save_figure, subplots
from pipeline.studies.run import Run
from pipeline.studies.settings import ReportParams

pd = lazy("pandas")


@dataclass
class Inputs:
    metrics: dict
    curves: pd.DataFrame


def load(run: Run) -> Inputs | None:
    """None when the stage did not run."""
    if not paths.SELECTIVE_METRICS.is_file():
        return None
    metrics = json.loads(paths.SELECTIVE_METRICS.read_text())
    if "confident_margin" not in metrics:
        raise ArtifactError(f"{paths.SELECTIVE_METRICS} has no confident top-1 or item AUROC intervals: it was written "
                            f"before them; rerun the selective stage (dvc repro)")
    return Inputs(metrics, read_table(paths.SELECTIVE_CURVES))


def compute(params: ReportParams, measure: MeasureParams, inputs: Inputs) -> dict:
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


def shown(study: dict) -> dict:
    """Each map ungated and at each score's dev threshold: its quality and speed (`table`) and its gate judged on the
    eval items (`judged`); the maps evaluating the selected map (`selected`)."""
    rows, judged = [], []
    for name, facts in study["maps"].items():
        rows.append([name, "none (ungated)", "—", "—", "—", "0%", pct(facts["retention"]), pct(facts["gap_closure"]),
                     pct(facts["next_token_top1"]), f"{facts['target_ms'] / facts['handoff_ms']:.2f}x",
                     f"{facts['target'] / facts['handoff']:.2f}x"])
        for score, row in facts["scores"].items():
            rows.append([name, score + (" (best)" if score == facts["best"] else ""), f"{row['auroc_items']:.3f}",
                         f"{row['auroc_prompts']:.3f}", f"{row['threshold']:.4g}", *(pct_ci(row, key) for key in (
                             "fallback_rate", "retention", "gap_closure", "next_token_top1")),
                         f"{row['speedup']:.2f}x", f"{row['speedup_bound']:.2f}x"])
        count, items = facts["confident_prompts"], f"{facts['items']} ({facts['changed_item_count']})"
        judged.append([name, "none (ungated)", "—", items, pct(facts["next_token_top1"]),
                       pct_ci_n(facts, "confident_top1", count)])
        judged += [[name, score, _auroc(row), items, pct(row["next_token_top1"]),
                    pct_ci_n(row, "confident_top1", count)] for score, row in facts["scores"].items()]
    return {"table": md_table(["Map", "Score", "AUROC items", "AUROC prompts", "Threshold", "Fallback (eval items)",
                               "Retention", "Gap closure", "Next-token top-1", "Speedup measured", "Speedup bound"],
                              rows),
            "judged": md_table(["Map", "Score (dev threshold)", "AUROC items [95% CI]", "Eval items (changed)",
                                "Next-token top-1", "Confident top-1 [95% CI] (n prompts)"], judged),
            "selected": [name for name, facts in study["maps"].items() if facts["file"] == str(paths.SELECTED_MAPPER)]}


def _auroc(row: dict) -> str:
    return f"{row['auroc_items']:.3f} [{row['auroc_items_low']:.3f}, {row['auroc_items_high']:.3f}]"


def figure(study: dict, folder: Path) -> dict[str, pd.DataFrame]:
    """Per map: eval-item retention against fallback rate and speedup bound, one line per score (oracle and random
    gates dashed)."""
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
    top1_figure(study, curves[curves.requests == "prompts"], folder)
    return {"selective": curves}


def top1_figure(study: dict, prompts: pd.DataFrame, folder: Path) -> None:
    """Per map against fallback rate, a colour per score: eval prompts' next-token top-1 (solid), confident (dotted)."""
    maps = list(study["maps"])
    fig, axes = subplots(1, len(maps), figsize=(5 * len(maps), 3.5), squeeze=False)
    for ax, name in zip(axes[0], maps):
        for score, part in prompts[prompts["map"] == name].groupby("score", sort=False):
            line, = ax.plot(part.fallback_rate, part.next_token_top1, "-", marker=".", label=f"{score}: top-1")
            ax.plot(part.fallback_rate, part.confident_top1, ":", color=line.get_color(), label=f"{score}: confident")
        ax.set_xlabel("fallback rate (eval prompts)")
        ax.set_ylabel(f"agreement with the oracle ({name})")
        ax.set_title(f"{name}: {study['maps'][name]['confident_prompts']} of {study['maps'][name]['prompts']} "
                     f"prompts confident", fontsize=9)
        ax.legend(fontsize=6)
    fig.suptitle(f"Next-token top-1 and confident top-1 (margin >= {study['confident_margin']})")
    fig.tight_layout()
    save_figure(fig, folder / "selective_top1.png")
