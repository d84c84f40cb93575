"""The length study (`studies.length`): both maps paired prompt by prompt and item by item."""
import numpy as np
import pandas as pd
from helpers import measure_params
from helpers.report import report_params

from pipeline.studies import length, render


def test_the_length_study_pairs_both_maps_prompt_by_prompt_and_item_by_item():
    rng = np.random.default_rng(6)
    figures_ = {"fit_tokens": 16, "candidate": "linear_k1_lam0.001", "prompts": 40,
                "stripped": {"by_length": {}}, "rotated": {"by_length": {}}}
    rows = {}
    for tokens, worse in ((16, 0.0), (64, 1.0)):  # the rotated map falls behind only beyond the fit length
        nll = rng.random(40) + 1.0
        for space, extra in (("stripped", 0.0), ("rotated", worse)):
            rows[(space, tokens)] = pd.DataFrame({"prompt": range(40), "nll": nll + extra + 0.01 * rng.random(40),
                                                  "agree": (rng.random(40) < 0.8 - 0.5 * extra) * 4, "tokens": 4})
            keys = ("ppl_ratio", "agreement", "next_token_top1")
            figures_[space]["by_length"][str(tokens)] = {"prompts": dict.fromkeys(keys, 1.0)}
    context = np.r_[np.full(50, 20), np.full(50, 60)]  # 1-2x and 2-4x the fit length
    tasks = {space: pd.DataFrame({"task": "piqa", "item": range(100), "context_tokens": context,
                                  "acc": np.r_[rng.random(50) < 0.8, rng.random(50) < 0.8 - drop].astype(float)})
             for space, drop in (("stripped", 0.0), ("rotated", 0.5))}
    study = length.compute(report_params(), measure_params(bootstrap_iters=300), length.Inputs(figures_, rows, tasks))
    short, long = study["rows"]
    assert short["nll_sign_test"]["p"] > 0.01 and long["nll_sign_test"]["lower"] == 40
    assert long["agreement_diff"]["low"] > 0
    assert [b["bin"] for b in study["task_bins"]] == ["1-2x", "2-4x"] and study["task_bins"][1]["diff"]["low"] > 0
    assert "| 2-4x | 50 |" in render.section("length", study)
