"""The V0 variants where the oracle is sure: `measure.confident`'s figures with counts and intervals beside V0's top-1,
and the mapped variant's paired confident top-1 difference with every other."""
from __future__ import annotations

from pathlib import Path

from pipeline.measure.confident import MARGINS, confidence_intervals, confidence_summary, confident_prompts
from pipeline.measure.prompt_metrics import CONFIDENT, in_group
from pipeline.measure.settings import MeasureParams
from pipeline.measure.stats import mcnemar, paired_bootstrap
from pipeline.store import paths
from pipeline.store.artifacts import ArtifactError
from pipeline.store.lazy import lazy
from pipeline.studies.format import interval, md_table, pct, pct_ci, pct_ci_n
from pipeline.studies.run import Run
from pipeline.studies.settings import ReportParams
from pipeline.studies.variants import label, order

pd = lazy("pandas")


def load(run: Run) -> Run:
    """Refused when a variant's rows predate the per-position margins."""
    for variant, rows in run.prompts.items():
        if MARGINS not in rows:
            raise ArtifactError(f"{paths.variant_rows('prompts', paths.variant_folder(variant))} has no "
                                f"{MARGINS!r} column: it was evaluated before the confident metrics; rerun the "
                                f"evaluate stages (dvc repro)")
    return run


def comparison(a: pd.DataFrame, b: pd.DataFrame, margin: float, iters: int, seed: int) -> dict:
    """Confident-prompt top-1 of `a` minus `b` over the prompts the oracle is sure of; None (n 0) without one."""
    a, b = a.sort_values("prompt"), b.sort_values("prompt")
    sure = confident_prompts(a, margin)
    if not sure.any():
        return {"confident_diff": None, "confident_low": None, "confident_high": None, "confident_mcnemar_p": None,
                "confident_n": 0}
    x, y = a.first_agree.to_numpy()[sure], b.first_agree.to_numpy()[sure]
    paired = paired_bootstrap(x, y, iters, seed)
    return {"confident_diff": paired["diff"], "confident_low": paired["low"], "confident_high": paired["high"],
            "confident_mcnemar_p": mcnemar(x, y), "confident_n": paired["n"]}


def compute(params: ReportParams, measure: MeasureParams, run: Run) -> dict:
    margin, iters, seed = measure.confident_margin, *measure.bootstrap
    rows = {}
    for name in order(run.metrics):
        if name not in run.prompts:
            continue
        figures = confidence_summary(run.prompts[name], margin)
        rows[name] = {"label": label(name, run.metrics[name]),
                      "next_token_top1": run.metrics[name]["prompts"]["next_token_top1"], **figures,
                      **confidence_intervals(run.prompts[name], margin, iters, seed)}
    mapped = params.mapped_variant
    pairs = [(mapped, other) for other in rows if other not in (mapped, "oracle")] + [("oracle", mapped)]
    comparisons = {f"{a}_minus_{b}": comparison(run.prompts[a], run.prompts[b], margin, iters, seed)
                   for a, b in pairs if a in rows and b in rows}
    oracle = rows["oracle"]
    return {"margin": margin, "prompts": len(run.prompts["oracle"]), "confident_prompts": oracle["confident_prompts"],
            "confident_prompt_share": oracle["confident_prompt_share"],
            "positions": int(run.prompts["oracle"].tokens.sum()), "confident_positions": oracle["confident_positions"],
            "confident_position_share": oracle["confident_position_share"], "variants": rows,
            "comparisons": comparisons}


def shown(study: dict) -> dict:
    return {"table": md_table(
        ["Variant", "Next-token top-1 (V0)", "Confident-prompt top-1 [95% CI]",
         "Confident-position agreement [95% CI]", "Oracle-weighted agreement [95% CI]"],
        [[row["label"], pct(row["next_token_top1"]), pct_ci_n(row, "confident_top1", row["confident_prompts"]),
          pct_ci_n(row, "confident_agreement", row["confident_positions"]), pct_ci(row, "oracle_weighted_agreement")]
         for row in study["variants"].values()]),
        "comparisons": md_table(
            ["Comparison", "Confident top-1 Δ [95% CI]", "McNemar p", "n"],
            [[name.replace("_", " "), "n/a" if c["confident_diff"] is None else
              interval(c["confident_diff"], c["confident_low"], c["confident_high"]),
              "n/a" if c["confident_mcnemar_p"] is None else f"{c['confident_mcnemar_p']:.3g}",
              c["confident_n"]] for name, c in study["comparisons"].items()]) if study["comparisons"] else None}


def headline(study: dict, variant: str) -> dict:
    """The figures of `variant` that `dvc metrics diff` compares beside V0's columns."""
    row = study.get("variants", {}).get(variant)
    return {} if row is None else {metric.name: row[metric.name] for metric in in_group(CONFIDENT)}


def figure(study: dict, folder: Path) -> dict[str, pd.DataFrame]:
    """No figure: the table says it all."""
    return {}
