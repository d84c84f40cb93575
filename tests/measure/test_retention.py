"""Retention and gap closure (`measure.retention`) exactly as PROTOCOL defines them, checked on V0's own figures."""
import numpy as np
import pandas as pd
import pytest

from pipeline.measure.retention import gap_closure, mean_retention, prompt_gap_closure, retention
from pipeline.studies.variants import V0


def test_retention_reproduces_v0_headline():
    oracle = {"hellaswag": V0["oracle"][2], "piqa": V0["oracle"][3]}
    k1 = {"hellaswag": V0["mapped_k1"][2], "piqa": V0["mapped_k1"][3]}
    k4 = {"hellaswag": V0["mapped_k4"][2], "piqa": V0["mapped_k4"][3]}
    assert retention(0.546, 0.594, 0.25) == pytest.approx(0.8605, abs=1e-4)
    assert round(100 * mean_retention(k1, oracle), 1) == 85.1
    assert round(100 * mean_retention(k4, oracle), 1) == 76.4


def test_gap_closure_is_the_share_of_the_source_to_oracle_gap_a_variant_closes():
    assert gap_closure(0.6, 0.5, 0.75) == pytest.approx(0.4)
    assert gap_closure(0.5, 0.5, 0.75) == 0.0 and gap_closure(0.75, 0.5, 0.75) == 1.0
    assert gap_closure(0.45, 0.5, 0.75) == pytest.approx(-0.2)  # worse than the source alone
    assert np.isnan(gap_closure(0.6, 0.7, 0.7))  # the oracle does not beat the source: no gap to close


def test_gap_closure_on_the_eval_prompts_reads_next_token_top1_and_log_perplexity():
    prompts = {name: pd.DataFrame({"prompt": range(8), "first_agree": agree, "nll": nll, "tokens": 4})
               for name, agree, nll in (("source", [1, 0] * 4, 12.0), ("oracle", 1, 8.0),
                                        ("mapped", [1, 1, 1, 0] * 2, 10.0))}
    top1 = prompt_gap_closure(prompts, "mapped", "next_token_top1", 500, 0)
    log_ppl = prompt_gap_closure(prompts, "mapped", "log_perplexity", 500, 0)
    assert top1["gap_closure"] == pytest.approx(0.5) and top1["low"] <= 0.5 <= top1["high"]
    assert log_ppl == {"gap_closure": pytest.approx(0.5), "low": pytest.approx(0.5), "high": pytest.approx(0.5)}
    worse = {**prompts, "mapped": prompts["mapped"].assign(nll=14.0)}  # above the source's: a negative closure
    assert prompt_gap_closure(worse, "mapped", "log_perplexity", 100, 0)["gap_closure"] == pytest.approx(-0.5)
