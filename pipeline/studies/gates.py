"""The gates, declared in params before the run (`report.gates`), each measured on the selected variant: the
controls, retention and gap-closure floors (the gap closure on the measure `report.gap_closure_metric` names),
the perplexity ratio, beating the source alone and the nulls, non-inferiority to the oracle, and V0's agreement
milestone."""
from __future__ import annotations

from pipeline.measure.retention import PROMPT_MEASURES
from pipeline.studies.settings import ReportParams

# the variant's figure each gap-closure measure reads
GAP_CLOSURE_KEYS = {"tasks": "gap_closure", **{m: f"gap_closure_{m}" for m in PROMPT_MEASURES}}
GATE_NAMES = {"agreement_milestone": "agreement milestone (next-token top-1)"}


def gates(params: ReportParams, chosen: dict, comparisons: dict, controls: dict, present: list[str]) -> dict:
    """Each gate's verdict, threshold and measured value for the selected variant's figures (`chosen`)."""
    g, mapped = params.gates, params.mapped_variant
    closure = chosen.get(GAP_CLOSURE_KEYS[params.gap_closure_metric])  # the measure declared before the run
    beats = {other: comparisons[f"{mapped}_minus_{other}"]["tasks_low"] > 0
             for other in ("source", "zero", "shuffled") if other in present}
    oracle_lead = comparisons[f"oracle_minus_{mapped}"]["tasks_high"]
    return {
        "controls_passed": {"passed": all(entry["passed"] for entry in controls.values()), "threshold": "all"},
        "retention_floor": gate(chosen["retention"] >= g.retention_floor, g.retention_floor, chosen["retention"]),
        "gap_closure_floor": {**gate(closure is not None and closure >= g.gap_closure_floor, g.gap_closure_floor,
                                     closure), "metric": params.gap_closure_metric},
        "perplexity_ratio": gate(chosen["ppl_ratio"] <= g.perplexity_ratio_limit, g.perplexity_ratio_limit,
                                 chosen["ppl_ratio"]),
        "beats_source_and_nulls": {"passed": bool(beats) and all(beats.values()),
                                   "threshold": "95% interval of the task-accuracy difference excludes 0",
                                   **{f"beats_{k}": v for k, v in beats.items()}},
        "noninferiority": gate(oracle_lead < g.noninferiority_margin, g.noninferiority_margin, oracle_lead),
        "agreement_milestone": {**gate(chosen["next_token_top1"] >= g.agreement_milestone, g.agreement_milestone,
                                       chosen["next_token_top1"]), "milestone": True},
    }


def gate(passed: bool, threshold: float, measured: float) -> dict:
    return {"passed": passed, "threshold": threshold, "measured": measured}


def verdict(result: dict) -> str:
    if result.get("milestone"):
        return "reached" if result["passed"] else "not reached"
    return "PASS" if result["passed"] else "FAIL"
