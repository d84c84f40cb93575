"""Agreement where the oracle is sure, and weighted by it: near-ties do not count against a map, a shuffled
variant scores far below, and no confident position is "n/a", not a division by zero."""
import numpy as np
import pytest
import torch
from helpers import periodic_batch
from helpers.confident import distributions, rows_of, swap_near_ties

from pipeline.kv.handoff import Handoff
from pipeline.measure.compare import oracle_outputs, variant_rows
from pipeline.measure.confident import confidence_intervals, confidence_summary, oracle_margin, oracle_probability
from pipeline.measure.prompt_metrics import prompt_figures
from pipeline.studies.confident import comparison


def test_a_variant_that_loses_only_near_ties_scores_one_where_the_oracle_is_sure_and_below_one_plainly():
    oracle = distributions(0)
    rows = rows_of(oracle, swap_near_ties(oracle))
    summary = confidence_summary(rows, 0.2)
    assert summary["confident_top1"] == 1.0 and summary["confident_agreement"] == 1.0
    assert rows.first_agree.mean() == pytest.approx(0.5)  # V0's column counts the ties against it
    assert np.concatenate(rows.agree_by_position.tolist()).mean() < 0.6
    assert summary["confident_prompts"] == 20 and summary["confident_prompt_share"] == 0.5
    assert summary["confident_positions"] == 100 and summary["confident_position_share"] == 0.5
    assert summary["oracle_weighted_agreement"] == pytest.approx((0.9 + 0.39) / 2, abs=1e-5)


def test_the_oracle_weighted_agreement_of_the_oracle_is_its_mean_top_probability():
    oracle = distributions(1)
    summary = confidence_summary(rows_of(oracle, oracle), 0.2)
    assert summary["oracle_weighted_agreement"] == pytest.approx(float(oracle.exp().amax(-1).mean()), abs=1e-6)


def test_a_shuffled_variant_scores_far_below_where_the_oracle_is_sure():
    oracle = distributions(2)
    shuffled = oracle[torch.randperm(len(oracle), generator=torch.Generator().manual_seed(0))]
    summary = confidence_summary(rows_of(oracle, shuffled), 0.2)
    assert summary["confident_top1"] < 0.5 and summary["confident_agreement"] < 0.5
    assert summary["oracle_weighted_agreement"] < 0.4
    faithful = confidence_summary(rows_of(oracle, oracle), 0.2)
    assert faithful["confident_top1"] - summary["confident_top1"] > 0.5


def test_a_margin_above_every_margin_counts_no_confident_prompt_and_gives_none_not_a_division_by_zero():
    oracle = distributions(3)
    rows = rows_of(oracle, oracle)
    summary = confidence_summary(rows, 0.95)
    assert summary["confident_prompts"] == 0 and summary["confident_positions"] == 0
    assert summary["confident_top1"] is None and summary["confident_agreement"] is None
    assert summary["confident_prompt_share"] == 0.0 and summary["oracle_weighted_agreement"] is not None
    bounds = confidence_intervals(rows, 0.95, 200, 0)
    assert bounds["confident_top1_low"] is None and bounds["confident_agreement_high"] is None
    assert comparison(rows, rows, 0.95, 200, 0) == {"confident_diff": None, "confident_low": None,
                                                    "confident_high": None, "confident_mcnemar_p": None,
                                                    "confident_n": 0}


def test_the_intervals_hold_the_figures_and_the_paired_difference_counts_the_confident_prompts():
    oracle = distributions(4)
    faithful, shuffled = rows_of(oracle, oracle), rows_of(oracle, oracle[torch.randperm(len(oracle))])
    figures, bounds = confidence_summary(shuffled, 0.2), confidence_intervals(shuffled, 0.2, 500, 0)
    for name in ("confident_top1", "confident_agreement", "oracle_weighted_agreement"):
        assert bounds[f"{name}_low"] <= figures[name] <= bounds[f"{name}_high"], name
        assert bounds[f"{name}_low"] < bounds[f"{name}_high"], name
    difference = comparison(faithful, shuffled, 0.2, 500, 0)
    assert difference["confident_n"] == 20 and difference["confident_low"] > 0
    assert difference["confident_diff"] == pytest.approx(1.0 - figures["confident_top1"])


def test_a_single_stored_token_bounds_the_margin_by_the_rest_of_the_distribution():
    logprobs = torch.tensor([[0.7, 0.2, 0.1], [0.4, 0.35, 0.25]]).log()
    assert oracle_margin(logprobs[:, :1]).tolist() == pytest.approx([0.4, -0.2])
    assert oracle_margin(logprobs).tolist() == pytest.approx([0.5, 0.05])
    ids = torch.tensor([[0, 1], [2, 0]])
    assert oracle_probability(logprobs.gather(-1, ids), ids, torch.tensor([1, 1])).tolist() == pytest.approx([0.2, 0])


def test_the_stored_rows_give_the_oracle_full_confident_agreement_and_its_mean_top_probability(periodic_model):
    sequences = periodic_batch(torch.Generator().manual_seed(2), 12, 34, 32).tolist()
    prompts = [(s[:24], s[24:]) for s in sequences]
    stored = oracle_outputs(Handoff(periodic_model), prompts, top_k=64, horizon=6, batch_size=5, progress=False)
    rows = variant_rows(Handoff(periodic_model), prompts, stored, batch_size=5, progress=False)
    summary = confidence_summary(rows, 0.2)
    assert summary["confident_prompts"] > 0 and summary["confident_top1"] == 1.0
    assert summary["confident_agreement"] == 1.0
    top = stored["top_logprobs"][:, :, 0].exp()  # (N, m): every continuation here is m = 10 long
    assert summary["oracle_weighted_agreement"] == pytest.approx(float(top.mean()), abs=1e-5)
    assert prompt_figures(rows, 0.2)["next_token_top1"] == 1.0  # the existing figures are untouched
    null = confidence_summary(variant_rows(Handoff(periodic_model, periodic_model, "zero"), prompts, stored,
                                           batch_size=5, progress=False), 0.2)
    assert null["oracle_weighted_agreement"] < summary["oracle_weighted_agreement"] - 0.2
