"""The distillation study (stage `distill`): each distilled map beside the fitted map it started from, on the select
split and, where the candidates stage scored both, on the eval part."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.measure.retention import paired_items
from pipeline.measure.settings import MeasureParams
from pipeline.measure.stats import mcnemar, paired_bootstrap
from pipeline.store import paths
from pipeline.store.artifacts import read_table
from pipeline.store.lazy import lazy
from pipeline.studies.format import interval, md_table, pct, pct_ci, save_figure, subplots
from pipeline.studies.run import Run, quality
from pipeline.studies.settings import ReportParams

pd = lazy("pandas")

SELECT_FIGURES = ("next_token_top1", "agreement", "rollout_agreement", "mean_kl")


@dataclass
class Inputs:
    distill: dict  # metrics/distill.json
    curves: dict[str, pd.DataFrame]  # per distilled map, per epoch
    select: dict  # metrics/select.json
    items: dict[str, pd.DataFrame]  # the oracle's and the source's items, and both maps' where the candidates ran
    prompts: dict[str, pd.DataFrame]  # both maps' rows on the eval prompts, where the candidates ran


def load(run: Run) -> Inputs | None:
    if not paths.DISTILL.is_file():
        return None
    distill = json.loads(paths.DISTILL.read_text())
    names = [*distill["maps"], *(facts["start"] for facts in distill["maps"].values())]
    candidates = {name: paths.candidate_items(name) for name in names}
    items = {**run.items, **{name: read_table(path) for name, path in candidates.items() if path.is_file()}}
    curves = {name: pd.read_csv(paths.distill_curve(name)) for name in distill["maps"]}
    prompt_rows = {name: paths.candidate_prompts(name) for name in names}
    prompts = {name: read_table(path) for name, path in prompt_rows.items() if path.is_file()}
    return Inputs(distill, curves, run.select, items, prompts)


# per-prompt figures on the eval prompts: name -> (rows -> one value per prompt), higher better but for the KL
PER_PROMPT = {"next_token_top1": lambda rows: rows.first_agree.to_numpy(float),
              "rollout_agreement": lambda rows: (rows.rollout_agree / rows.horizon).to_numpy(float),
              "mean_kl": lambda rows: (rows.kl / rows.tokens).to_numpy(float)}


def prompt_differences(before: pd.DataFrame, after: pd.DataFrame, iters: int, seed: int) -> dict:
    """Each per-prompt figure before and after, after - before with its interval, McNemar's p for the 0/1 one."""
    before, after = before.sort_values("prompt"), after.sort_values("prompt")
    out = {}
    for key, values in PER_PROMPT.items():
        x, y = values(after), values(before)
        difference = paired_bootstrap(x, y, iters, seed)
        out.update({f"eval_{key}_before": float(y.mean()), f"eval_{key}_after": float(x.mean()),
                    f"eval_{key}_diff": difference["diff"], f"eval_{key}_low": difference["low"],
                    f"eval_{key}_high": difference["high"]})
    out["eval_next_token_top1_mcnemar_p"] = mcnemar(PER_PROMPT["next_token_top1"](after),
                                                    PER_PROMPT["next_token_top1"](before))
    out["eval_prompts"] = len(before)
    return out


def compute(params: ReportParams, measure: MeasureParams, inputs: Inputs) -> dict:
    rows = {}
    for name, facts in inputs.distill["maps"].items():
        start = facts["start"]
        row = {"start": start, **{key: facts[key] for key in ("best_epoch", "epochs", "steps", "seconds", "lr",
                                                               "kv_weight", "probe_steps", "select_kl_start",
                                                               "select_kl")},
               "probes": facts.get("probes", {})}  # none when the grids hold one (rate, kv_weight) pair
        for when, which in (("before", start), ("after", name)):
            scores = inputs.select.get("maps", {}).get(which, {}).get("prompts", {})
            row.update({f"{key}_{when}": scores.get(key) for key in SELECT_FIGURES})
        if start in inputs.items and name in inputs.items and "source" in inputs.items:
            for when, which in (("before", start), ("after", name)):
                row.update(quality(inputs.items, which, params, measure, suffix=f"_{when}"))
            after, before = paired_items(inputs.items, name, start, params.retention_metric)
            difference = paired_bootstrap(after, before, *measure.bootstrap)
            row.update({"tasks_diff": difference["diff"], "tasks_low": difference["low"],
                        "tasks_high": difference["high"], "tasks_n": difference["n"],
                        "tasks_mcnemar_p": mcnemar(after, before)})
        if start in inputs.prompts and name in inputs.prompts:
            row.update(prompt_differences(inputs.prompts[start], inputs.prompts[name], *measure.bootstrap))
        rows[name] = row
    return {"rows": rows, "rows_fit": inputs.distill["rows_fit"], "rows_select": inputs.distill["rows_select"],
            "cost_s": inputs.distill["cost_s"],
            "curves": {name: curve[["epoch", "select_kl", "select_agreement"]].to_dict(orient="list")
                       for name, curve in inputs.curves.items()}}


def _arrow(row: dict, key: str, percent: bool = True) -> str:
    before, after = row.get(f"{key}_before"), row.get(f"{key}_after")
    if before is None or after is None:
        return "—"
    written = pct if percent else (lambda v: f"{v:.3f}")
    return f"{written(before)} → {written(after)}"


def _difference(row: dict, key: str, scale: float = 100, fmt: str = "+.1f") -> str:
    return interval(row[f"{key}_diff"], row[f"{key}_low"], row[f"{key}_high"], scale=scale, fmt=fmt)


def shown(study: dict) -> dict:
    """`kept`: the maps no epoch of which beat their start."""
    rows = study["rows"]
    probed = {name: r for name, r in rows.items() if r["probes"]}
    evaluated = {name: r for name, r in rows.items() if "tasks_diff" in r}
    on_prompts = {name: r for name, r in rows.items() if "eval_prompts" in r}
    return {
        "select": md_table(["Map", "Start", "Next-token top-1", "Agreement", "Rollout agreement", "Mean KL",
                            "Best epoch / run", "Seconds"],
                           [[name, r["start"], _arrow(r, "next_token_top1"), _arrow(r, "agreement"),
                             _arrow(r, "rollout_agreement"), _arrow(r, "mean_kl", percent=False),
                             f"{r['best_epoch']} / {r['epochs']}", f"{r['seconds']:.0f}"] for name, r in rows.items()]),
        "probes": md_table(["Map", "Select KL at the start", "Rate × kv_weight → select KL after the probe",
                            "Chosen rate", "Chosen kv_weight"],
                           [[name, _kl(r["select_kl_start"]), probe_cells(r), f"{r['lr']:g}", f"{r['kv_weight']:g}"]
                            for name, r in probed.items()]) if probed else None,
        "probe_steps": sorted({r["probe_steps"] for r in probed.values()}),
        "kept": [name for name, r in rows.items() if r["best_epoch"] == 0],
        "evaluated": md_table(
            ["Map", "Retention before", "Retention after", "Gap closure before", "Gap closure after",
             "Tasks Δ [95% CI]", "McNemar p", "n"],
            [[name, *(pct_ci(r, f"{key}_{when}") for key in ("retention", "gap_closure")
                      for when in ("before", "after")), _difference(r, "tasks"), f"{r['tasks_mcnemar_p']:.3g}",
              r["tasks_n"]] for name, r in evaluated.items()]) if evaluated else None,
        "prompts": md_table(
            ["Map", "Next-token top-1", "Δ [95% CI]", "McNemar p", "Rollout agreement", "Δ [95% CI]", "Mean KL",
             "Δ [95% CI]", "n"],
            [[name, _arrow(r, "eval_next_token_top1"), _difference(r, "eval_next_token_top1"),
              f"{r['eval_next_token_top1_mcnemar_p']:.3g}", _arrow(r, "eval_rollout_agreement"),
              _difference(r, "eval_rollout_agreement"), _arrow(r, "eval_mean_kl", percent=False),
              _difference(r, "eval_mean_kl", scale=1, fmt="+.3f"), r["eval_prompts"]]
             for name, r in on_prompts.items()]) if on_prompts else None,
    }


def _kl(value: float | None) -> str:
    return "diverged" if value is None else f"{value:.4f}"


def probe_cells(r: dict) -> str:
    cells = []
    for rate, weights in sorted(r["probes"].items(), key=lambda item: float(item[0])):
        for weight, kl in sorted(weights.items(), key=lambda item: float(item[0])):
            cell = f"{rate} × {weight}: {_kl(kl)}"
            cells.append(f"**{cell}**" if (float(rate), float(weight)) == (r["lr"], r["kv_weight"]) else cell)
    return " · ".join(cells)


def figure(study: dict, folder: Path) -> dict[str, pd.DataFrame]:
    fig, ax = subplots(figsize=(6, 4))
    for name, curve in study["curves"].items():
        ax.plot(curve["epoch"], curve["select_kl"], marker="o", markersize=3, label=name)
    ax.set_xlabel("epoch (0: the fitted start map)")
    ax.set_ylabel("select KL(oracle || mapped)")
    ax.set_title("Distillation through the frozen target")
    ax.legend(fontsize=8)
    save_figure(fig, folder / "distillation.png")
    table = pd.concat([pd.DataFrame({"map": name, "epoch": curve["epoch"], "select_kl": curve["select_kl"]})
                       for name, curve in study["curves"].items()], ignore_index=True)
    return {"distillation": table}
