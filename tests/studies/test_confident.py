"""The confident-agreement study (`studies.confident`): confident agreement beside V0's top-1, "n/a" where no
prompt is confident, and rows evaluated before the margins refused with the fix."""
import pandas as pd
import pytest
import torch
from helpers import committed, measure_params
from helpers.confident import distributions, rows_of, swap_near_ties

from pipeline.store.artifacts import ArtifactError
from pipeline.store.params import parse
from pipeline.studies import confident, render
from pipeline.studies.run import Run
from pipeline.studies.settings import ReportParams


def study_run(margin_rows: dict[str, pd.DataFrame]):
    """A V0 run whose variants left `margin_rows` (their tokens: each prompt's positions) and V0's top-1."""
    prompts = {name: rows.assign(tokens=len(rows.agree_by_position[0])) for name, rows in margin_rows.items()}
    metrics = {name: {"prompts": {"next_token_top1": float(rows.first_agree.mean())}} for name, rows in prompts.items()}
    return Run(metrics, {}, prompts, skipped={}, controls={}, select={}, latency=None,
               pair=("models/source", "models/target"), calibration_sizes=[], operating_lengths=[])


def test_the_study_puts_confident_agreement_beside_v0s_top1_and_writes_na_where_no_prompt_is_confident():
    oracle = distributions(5)
    run = study_run({"oracle": rows_of(oracle, oracle), "selected": rows_of(oracle, swap_near_ties(oracle)),
                     "shuffled": rows_of(oracle, oracle[torch.randperm(len(oracle))])})
    study = confident.compute(parse(ReportParams, committed("report"), "report"), measure_params(), confident.load(run))
    selected = study["variants"]["selected"]
    assert selected["next_token_top1"] == 0.5 and selected["confident_top1"] == 1.0
    assert study["confident_prompts"] == 20 and study["positions"] == 200
    assert study["comparisons"]["selected_minus_shuffled"]["confident_low"] > 0
    assert set(study["comparisons"]) == {"selected_minus_shuffled", "oracle_minus_selected"}
    text = render.section("confident", study)
    assert "| Selected mapped transfer | 50.0% | 100.0% [100.0%, 100.0%] (n = 20) |" in text
    assert "20 of 40 (50.0%)" in text
    assert confident.headline(study, "selected")["confident_top1"] == 1.0 and confident.headline({}, "selected") == {}
    report = parse(ReportParams, committed("report"), "report")
    unsure = confident.compute(report, measure_params(confident_margin=0.95), run)
    text = render.section("confident", unsure)
    assert "| Selected mapped transfer | 50.0% | n/a (n = 0) | n/a (n = 0) |" in text and "0 of 40 (0.0%)" in text


def test_rows_evaluated_before_the_margins_are_refused_with_the_fix():
    oracle = distributions(6)
    run = study_run({"oracle": rows_of(oracle, oracle).drop(columns="margin_by_position")})
    with pytest.raises(ArtifactError, match="rerun the evaluate stages"):
        confident.load(run)
