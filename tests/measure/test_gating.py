"""Gating measures (`measure.gating`): AUROC and its interval, the threshold rule, item quality, the oracle and
random curves, the effective speedup, and confident top-1 under the gate."""
import math

import numpy as np
import pandas as pd
import pytest

from pipeline.measure import gating


def test_auroc_of_a_constructed_case():
    assert gating.auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert gating.auroc([1, 1, 1, 1], [0, 1, 0, 1]) == pytest.approx(0.5)  # ties count one half
    assert gating.auroc([3, 2, 1], [1, 1, 0]) == 1.0
    assert math.isnan(gating.auroc([1, 2], [1, 1]))


def _items(mapped, oracle, task="piqa"):
    return pd.DataFrame({"task": task, "item": range(len(mapped)), "mapped": mapped, "oracle": oracle})


def test_the_threshold_is_the_highest_that_reaches_the_declared_quality_on_its_split():
    items = _items(mapped=[0, 1, 1, 0, 1, 1], oracle=[1, 1, 1, 1, 1, 1])  # PIQA: chance 0.5
    scores = np.array([0.9, 0.1, 0.2, 0.7, 0.3, 0.4])  # the two wrong items score highest

    def quality(fallback: np.ndarray) -> float:
        return gating.item_quality(items, fallback)["retention"]

    assert gating.choose_threshold(scores, quality, 1.0) == pytest.approx(0.4)  # falls back on 0.9 and 0.7 only
    assert gating.choose_threshold(scores, quality, 0.3) == float("inf")  # ungated: (4/6 - .5) / .5 = 0.33
    assert gating.choose_threshold(np.zeros(6), quality, 1.0) == float("-inf")  # no score separates them


def test_item_quality_is_the_mean_over_tasks_of_each_tasks_retention_and_gap_closure_whatever_the_row_order():
    items = pd.DataFrame({"task": ["piqa", "hellaswag"] * 4, "item": range(8),
                          "mapped": [1, 1, 1, 0, 0, 0, 0, 1], "oracle": [1, 1, 1, 1, 1, 1, 0, 1],
                          "source": [0, 0, 0, 0, 0, 0, 0, 1]})
    # hellaswag (chance 0.25): mapped 0.5, oracle 1, source 0.25; piqa (chance 0.5): mapped 0.5, oracle 0.75, source 0
    ungated = gating.item_quality(items, np.zeros(8, bool))
    assert ungated["retention"] == pytest.approx(((0.5 - 0.25) / 0.75 + 0) / 2)
    assert ungated["gap_closure"] == pytest.approx(((0.5 - 0.25) / 0.75 + 0.5 / 0.75) / 2)
    fallback = np.array([False, False, False, True, False, False, False, False])  # one hellaswag miss: the oracle's
    assert gating.item_quality(items, fallback)["retention"] == pytest.approx(((0.75 - 0.25) / 0.75 + 0) / 2)
    shuffled = [7, 2, 4, 0, 6, 1, 3, 5]
    assert gating.item_quality(items.iloc[shuffled].reset_index(drop=True), fallback[shuffled]) == \
        pytest.approx(gating.item_quality(items, fallback))
    assert math.isnan(gating.item_quality(items.drop(columns="source"), fallback)["gap_closure"])


def test_the_oracle_curve_reaches_the_oracle_at_the_share_the_map_changes_and_random_is_in_between():
    items = _items(mapped=[0, 1, 0, 1, 1, 1, 1, 1], oracle=[1] * 8)
    changed = items.mapped != items.oracle
    references = gating.reference_scores(changed, seed=0)
    rates = [0.0, 0.25, 1.0]
    oracle = gating.curve(items, references["oracle"], gating.item_quality, rates, seed=0)
    assert [row["retention"] for row in oracle] == pytest.approx([0.5, 1.0, 1.0])
    random = gating.curve(items, references["random"], gating.item_quality, rates, seed=0)
    assert random[0]["retention"] == 0.5 and random[-1]["retention"] == 1.0


def test_the_effective_speedup_is_the_handoff_alone_without_fallback_and_below_one_with_all():
    assert gating.effective_speedup(10.0, 4.0, 1.0, 0.0) == pytest.approx(2.0)
    assert gating.effective_speedup(10.0, 4.0, 1.0, 1.0) < 1.0


def test_the_auroc_interval_brackets_the_auroc_and_a_score_blind_to_the_labels_straddles_one_half():
    rng = np.random.default_rng(0)
    changed = rng.random(300) < 0.35
    scores = changed + rng.normal(size=300)  # informative: AUROC about 0.76
    area, (low, high) = gating.auroc(scores, changed), gating.auroc_interval(scores, changed, 2000, 0)
    assert 0.5 < low < area < high < 1
    # the control fails on a broken input: the same scores detached from their requests tell nothing
    blind = gating.auroc_interval(rng.permutation(scores), changed, 2000, 0)
    assert blind[0] < 0.5 < blind[1]
    assert gating.auroc_interval(scores, changed, 2000, 0) == (low, high)  # seeded
    assert all(math.isnan(bound) for bound in gating.auroc_interval(scores, np.ones(300, bool), 2000, 0))


def _prompts(first_agree, confident) -> pd.DataFrame:
    return pd.DataFrame({"first_agree": first_agree, "rollout_agree": [2 * a for a in first_agree],
                         "horizon": 2, "confident": confident})


def test_confident_top1_under_the_gate_counts_only_the_prompts_where_the_oracle_is_sure():
    prompts = _prompts([1, 0, 1, 0, 0, 1], [True, True, True, False, False, False])
    fallback = np.zeros(6, bool)
    assert gating.prompt_quality(prompts, fallback)["next_token_top1"] == pytest.approx(3 / 6)
    assert gating.prompt_quality(prompts, fallback)["confident_top1"] == pytest.approx(2 / 3)
    fallback[3] = True  # a near-tie the map missed: top-1 gains, the confident top-1 cannot
    assert gating.prompt_quality(prompts, fallback)["next_token_top1"] == pytest.approx(4 / 6)
    assert gating.prompt_quality(prompts, fallback)["confident_top1"] == pytest.approx(2 / 3)
    fallback[1] = True  # the confident prompt the map missed: the oracle's answer
    assert gating.prompt_quality(prompts, fallback)["confident_top1"] == 1.0
    assert math.isnan(gating.prompt_quality(prompts.assign(confident=False), fallback)["confident_top1"])
    assert set(gating.prompt_quality(prompts.drop(columns="confident"), fallback)) == {"next_token_top1",
                                                                                      "rollout_agreement"}
