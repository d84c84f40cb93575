"""Long-context measures (`measure.retrieval`): pass-key exact match, the selection recall of the key's tokens and
agreement on recall positions."""
import pandas as pd
import pytest

from pipeline.measure.retrieval import (
    exact_match,
    key_positions,
    needle_selected,
    recall_agreement,
    recall_positions,
    retrieval_rows,
    retrieval_summary,
)


def test_exact_match_needs_every_token_of_the_key_and_reads_no_further():
    assert exact_match([7, 1, 4, 3, 2, 99, 98], [7, 1, 4, 3, 2])
    assert not exact_match([7, 1, 4, 3, 9], [7, 1, 4, 3, 2])  # one wrong digit
    assert not exact_match([1, 7, 4, 3, 2], [7, 1, 4, 3, 2])  # the right digits in another order
    assert not exact_match([7, 1, 4], [7, 1, 4, 3, 2])  # stopped short


def test_a_recall_position_extends_an_n_gram_the_prompt_holds():
    prompt = [5, 1, 2, 3, 9, 8]
    # the sequence ... 9 8 | 1 2 3 4: "1 2 3" is in the prompt (recall at 3); "2 3 4" is not
    assert recall_positions(prompt, [1, 2, 3, 4], 3) == [False, False, True, False]
    # with n = 2: "8 1" (across the prompt's end) no, "1 2" yes, "2 3" yes, "3 4" no
    assert recall_positions(prompt, [1, 2, 3, 4], 2) == [False, True, True, False]
    # an n-gram across the prompt's end counts when the prompt holds it: "... 3 9 | 8", and "3 9 8" opens the prompt
    assert recall_positions([3, 9, 8, 3, 9], [8], 3) == [True]


def test_recall_agreement_splits_the_positions_and_counts_them():
    figures = recall_agreement([[1, 0, 1], [0, 0]], [[True, True, False], [False, True]])
    assert figures == {"recall_agreement": pytest.approx(1 / 3), "recall_positions": 3,
                       "other_agreement": pytest.approx(1 / 2), "other_positions": 2}
    assert recall_agreement([[1]], [[False]])["recall_agreement"] is None


def test_retrieval_is_scored_per_depth_and_against_the_oracle():
    items = pd.DataFrame({"depth": [0.1, 0.1, 0.5, 0.5], "key": ["12", "34", "56", "78"],
                          "continuation_ids": [[1, 2], [3, 4], [5, 6], [7, 8]]})
    oracle = retrieval_rows(items, [[1, 2], [3, 4], [5, 6], [0, 0]])
    variant = retrieval_rows(items, [[1, 2], [3, 0], [5, 6], [7, 8]])
    assert list(oracle.exact) == [True, True, True, False] and list(variant.exact) == [True, False, True, True]
    summary = retrieval_summary(variant, oracle)
    assert summary["exact_match"] == 0.75 and summary["n"] == 4
    assert summary["by_depth"] == {"0.1": 0.5, "0.5": 1.0}
    assert summary["of_oracle"] == 1.0 and summary["of_oracle_by_depth"] == {"0.1": 0.5, "0.5": 2.0}


def test_selection_recall_is_1_when_every_key_token_was_selected_and_0_when_one_was_not():
    prompt, key = [9, 9, 4, 1, 2, 9, 9, 8], [1, 2]  # the key at positions 3 and 4
    assert key_positions(prompt, key) == [3, 4]
    assert needle_selected([0, 3, 4, 7], prompt, key)
    assert not needle_selected([0, 3, 7], prompt, key)  # its second token was not computed
    assert not needle_selected([], prompt, key)
    with pytest.raises(ValueError, match="stated 0 times"):
        key_positions(prompt, [5, 5])
    with pytest.raises(ValueError, match="stated 2 times"):
        key_positions([1, 2, 1, 2], key)


def test_the_selection_recall_is_over_the_items_whose_handoff_chose_positions():
    items = pd.DataFrame({"depth": [0.1, 0.5, 0.5], "key": ["12", "34", "56"],
                          "continuation_ids": [[1, 2], [3, 4], [5]],
                          "prompt_ids": [[1, 2, 0, 0], [0, 3, 4, 0], [0, 0, 5, 0]]})
    greedy = [[1, 2], [3, 4], [5]]
    rows = retrieval_rows(items, greedy, [[0, 1, 3], [0, 1, 3], None])
    assert list(rows.needle_selected) == [True, False, None]
    summary = retrieval_summary(rows)
    assert summary["selection_recall"] == 0.5 and summary["selection_n"] == 2
    unchosen = retrieval_rows(items, greedy)  # a handoff that chose nothing: no column, no figure
    assert "needle_selected" not in unchosen and "selection_recall" not in retrieval_summary(unchosen)
