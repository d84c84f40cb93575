"""The acceptance criteria, declared in params before the run (`report.criteria`), each measured on the selected
variant."""
from __future__ import annotations

from pipeline.measure.retention import PROMPT_MEASURES
from pipeline.studies.settings import ReportParams

# the variant's figure each gap-closure measure reads
GAP_CLOSURE_KEYS = {"tasks": "gap_closure", **{m: f"gap_closure_{m}" for m in PROMPT_MEASURES}}
CRITERION_NAMES = {"agreement_milestone": "agreement milestone (next-token top-1)"}


def criteria(params: ReportParams, chosen: dict, comparisons: dict, controls: dict, present: list[str]) -> dict:
    c, mapped = params.criteria, params.mapped_variant
    closure = chosen.get(GAP_CLOSURE_KEYS[params.gap_closure_metric])
    beats = {other: comparisons[f"{mapped}_minus_{other}"]["tasks_low"] > 0
             for other in ("source", "zero", "shuffled") if other in present}
    oracle_lead = comparisons[f"oracle_minus_{mapped}"]["tasks_high"]
    return {
        "controls_passed": {"passed": all(entry["passed"] for entry in controls.values()), "threshold": "all"},
        "retention_floor": criterion(chosen["retention"] >= c.retention_floor, c.retention_floor,
                                     chosen["retention"]),
        "gap_closure_floor": {**criterion(closure is not None and closure >= c.gap_closure_floor,
                                          c.gap_closure_floor, closure), "metric": params.gap_closure_metric},
        "perplexity_ratio": criterion(chosen["ppl_ratio"] <= c.perplexity_ratio_limit, c.perplexity_ratio_limit,
                                      chosen["ppl_ratio"]),
        "beats_source_and_nulls": {"passed": bool(beats) and all(beats.values()),
                                   "threshold": "95% interval of the task-accuracy difference excludes 0",
                                   **{f"beats_{k}": v for k, v in beats.items()}},
        "noninferiority": criterion(oracle_lead < c.noninferiority_margin, c.noninferiority_margin, oracle_lead),
        "agreement_milestone": {**criterion(chosen["next_token_top1"] >= c.agreement_milestone,
                                            c.agreement_milestone, chosen["next_token_top1"]), "milestone": True},
    }


def criterion(passed: bool, threshold: float, measured: float) -> dict:
    return {"passed": passed, "threshold": threshold, "measured": measured}


def verdict(result: dict) -> str:
    if result.get("milestone"):
        return "reached" if result["passed"] else "not reached"
    return "PASS" if result["passed"] else "FAIL"
