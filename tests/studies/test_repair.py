"""The repair study (`studies.repair`) on hand-made rows: its sentence names the cheapest setting that reaches the
oracle, each budget against the truncated prompt and speculative prefill, the source alone at budget zero, and the
frontier."""
import pandas as pd
import pytest
from helpers import committed, measure_params

from pipeline.measure.prompt_metrics import PROMPT_METRICS
from pipeline.store.params import parse
from pipeline.studies import render
from pipeline.studies.repair import SOURCE, Inputs, compute, figure, join, source_row
from pipeline.studies.settings import ReportParams


def _study(rows: list[dict]) -> dict:
    """A repair study of hand-made `rows`, the table's other cells filled in, at one pair and length."""
    filled = [{"policy": "p", "budget": 0.0, "retention": 0.5, "retention_low": 0.4, "retention_high": 0.6,
               "gap_closure": 0.0, "gap_closure_low": 0.0, "gap_closure_high": 0.0, "bound": None, "speedup": None,
               **dict.fromkeys(PROMPT_METRICS), **row} for row in rows]
    return {"rows": filled, "length": 256, "bound_pair": "qwen3-v0"}


def said(study: dict, start: str) -> list[str]:
    """The lines of the repair study's section that start with `start`."""
    return [line for line in render.section("repair", study).splitlines() if line.startswith(start)]


def cheapest(rows: list[dict]) -> str:
    """The section's sentence on each map's cheapest setting that reaches the oracle."""
    return said(_study(rows), "For `")[0]


def _row(name: str, setting: str, budget: float, high: float) -> dict:
    return {"map": name, "setting": setting, "budget": budget, "retention": high - 0.1, "retention_low": high - 0.2,
            "retention_high": high}


def test_the_sentence_names_the_cheapest_setting_whose_interval_reaches_the_oracle():
    rows = [_row("m", "none", 0.0, 0.9), _row("m", "tokens:0.2:recency", 0.2, 1.02),
            _row("m", "tokens:0.1:attention", 0.11, 1.0), _row("m", "layers:1", 0.05, 0.95),
            _row("truncated", "0.01", 0.01, 1.5), _row(SOURCE, "—", 0.0, 1.2)]
    sentence = cheapest(rows)
    assert "`tokens:0.1:attention`" in sentence and "tokens:0.2" not in sentence and "truncated" not in sentence
    assert SOURCE not in sentence


def test_the_sentence_says_none_reaches_when_no_interval_reaches_the_oracle():
    sentence = cheapest([_row("m", "none", 0.0, 0.9), _row("m", "layers:1", 0.05, 0.99)])
    assert sentence == "For `m` no setting's retention interval reaches the oracle."


def _level(name: str, setting: str, budget: float, retention: float) -> dict:
    return {"map": name, "setting": setting, "budget": budget, "retention": retention}


def test_each_budget_says_whether_each_maps_best_repair_beats_the_truncated_prompt():
    rows = [_level("a", "none", 0.0, 0.5), _level("a", "tokens:0.1:attention", 0.1071, 0.8),
            _level("a", "tokens:0.1:recency", 0.1069, 0.6), _level("b", "tokens:0.1:attention", 0.1071, 0.1),
            _level("a", "layers:1", 0.003, 0.4), _level("truncated", "0.107", 0.107, 0.2),
            _level("truncated", "0.003", 0.003, 0.45), _level(SOURCE, "—", 0.0, 0.7)]
    assert said(_study(rows), "- At ") == [
        "- At 0.3% of the target's prefill (truncated prompt 45.0%): `a`'s best, `layers:1` (40.0%), does not beat the "
        "truncated prompt.",
        "- At 10.7% of the target's prefill (truncated prompt 20.0%): `a`'s best, `tokens:0.1:attention` (80.0%), "
        "beats the truncated prompt; `b`'s best, `tokens:0.1:attention` (10.0%), does not beat the truncated prompt."]


def test_speculative_prefill_at_each_level_is_a_matched_baseline_beside_the_truncated_prompt():
    rows = [_level("a", "none", 0.0, 0.5), _level("a", "tokens:0.1:source_attention", 0.104, 0.8),
            _level("truncated", "0.104", 0.104, 0.2), _level("speculative", "0.104", 0.104, 0.85),
            _level(SOURCE, "—", 0.0, 0.7)]
    assert said(_study(rows), "- At ") == [
        "- At 10.4% of the target's prefill (truncated prompt 20.0%): `a`'s best, `tokens:0.1:source_attention` "
        "(80.0%), beats the truncated prompt and does not beat speculative prefill (85.0%)."]
    reaching = [{**row, "retention_low": 0.5, "retention_high": 1.1} for row in rows]
    assert "speculative" not in cheapest(reaching) and "`a`" in cheapest(reaching)  # a baseline, not a map


def test_the_study_reads_speculative_prefills_rows_at_each_level_with_its_bound_and_draws_them(tmp_path):
    params = parse(ReportParams, committed("report"), "report")
    items = {"oracle": _items([1] * 8), "source": _items([1, 1, 1, 1, 1, 0, 0, 1])}
    figures = {"prompts": {"next_token_top1": 0.5, "rollout_agreement": 0.4, "mean_kl": 0.3}}
    metrics = {"length": 256, "bound_pair": "qwen3-v0",
               "maps": {"m": {"none": {**figures, "policy": "none", "budget": 0.0, "bound": 3.0},
                              "tokens:0.1:source_attention": {**figures, "policy": "source_attention",
                                                              "budget": 0.104, "bound": 2.5}}},
               "truncated": {"0.104": figures}, "speculative": {"0.104": {**figures, "bound": 2.6}}}
    rows = {("m", "none"): _items([1, 0, 1, 0, 1, 0, 1, 0]), ("m", "tokens:0.1:source_attention"): _items([1] * 8),
            ("truncated", "0.104"): _items([0] * 8), ("speculative", "0.104"): _items([1, 1, 1, 1, 1, 1, 0, 1])}
    study = compute(params, measure_params(bootstrap_iters=50), Inputs(items, metrics, rows, figures))
    speculative = next(row for row in study["rows"] if row["map"] == "speculative")
    assert speculative["policy"] == "speculative prefill" and speculative["budget"] == 0.104
    assert speculative["bound"] == 2.6 and "vs_none" not in speculative
    assert [row["map"] for row in study["rows"]][-3:] == [SOURCE, "speculative", "truncated"]  # the baselines last
    text = render.section("repair", study)
    assert "| speculative | 0.104 | 10.4% | speculative prefill |" in text and "beats speculative prefill (" in text
    assert figure(study, tmp_path)["repair"]["map"].tolist().count("speculative") == 1


def _items(correct: list[int]) -> pd.DataFrame:
    rows = [{"task": task, "item": i, "acc": c, "acc_norm": c} for task in ("hellaswag", "piqa")
            for i, c in enumerate(correct)]
    return pd.DataFrame(rows)


def test_the_source_alone_is_a_row_at_budget_zero_with_its_own_figures_and_no_gap_closed():
    params = parse(ReportParams, committed("report"), "report")
    items = {"oracle": _items([1] * 8), "source": _items([1, 1, 1, 1, 1, 0, 0, 1])}
    figures = {"prompts": {"next_token_top1": 0.5, "rollout_agreement": 0.4, "mean_kl": 0.3}}
    row = source_row(params, measure_params(bootstrap_iters=50), Inputs(items, {}, {}, figures))
    assert row["map"] == SOURCE and row["budget"] == 0.0 and row["gap_closure"] == 0.0
    assert row["next_token_top1"] == 0.5 and row["retention"] == pytest.approx((0.75 - 0.25) / 0.75 / 2 + 0.5 / 2)
    assert row["confident_top1"] is None  # a source evaluated before the confident figures: shown as "—"
    figures["prompts"]["confident_top1"] = 0.75
    assert source_row(params, measure_params(), Inputs(items, {}, {}, figures))["confident_top1"] == 0.75


def _point(name: str, setting: str, closure: float, bound: float | None) -> dict:
    return {"map": name, "setting": setting, "gap_closure": closure, "bound": bound}


def test_the_frontier_gains_a_repaired_point_no_candidate_dominates_and_not_one_a_candidate_does():
    candidates = {"bound_pair": "qwen3-v0", "length": 256,
                  "rows": {"fast": {"gap_closure": 0.1, "bound_at_pair": 3.0},
                           "good": {"gap_closure": 0.9, "bound_at_pair": 2.4}}}
    study = _study([_point("good", "none", 0.9, 2.4), _point("good", "tokens:0.1:attention", 1.0, 2.0),
                    _point("fast", "layers:1", 0.05, 2.9), _point("truncated", "0.107", -2.0, None),
                    _point(SOURCE, "—", 0.0, None)])
    join(study, candidates)
    assert study["front"] == ["fast", "good", "good@tokens:0.1:attention"]
    assert study["front_gains"] == ["good@tokens:0.1:attention"]
    assert [row.get("front") for row in study["rows"]] == [None, True, False, None, None]
    assert said(study, "Over the candidates study's maps")[0].endswith("it gains `good@tokens:0.1:attention`.")


def test_no_frontier_is_joined_across_studies_counted_at_other_lengths():
    candidates = {"bound_pair": "qwen3-v0", "length": 1024, "rows": {"a": {"gap_closure": 0.1, "bound_at_pair": 3.0}}}
    study = _study([_point("a", "layers:1", 0.2, 2.9)])
    join(study, candidates)
    assert "front" not in study and "front" not in study["rows"][0]
    assert said(study, "Over the candidates study's maps") == []
