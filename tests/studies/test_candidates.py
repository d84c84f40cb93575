"""The candidates study (`studies.candidates`): every candidate's retention, gap closure, proxy correlations and
place on the front."""
import numpy as np
from helpers import measure_params
from helpers.report import _fake_variant, report_params

from pipeline.studies import candidates, render


def test_every_candidate_gets_retention_gap_closure_proxy_correlations_and_its_place_on_the_front():
    rng = np.random.default_rng(4)
    items = {name: _fake_variant(rng, *acc, 1.0)[1] for name, acc in {"oracle": (0.9, 0.95),
                                                                     "source": (0.7, 0.8)}.items()}
    quality = {"c_low": (0.7, 0.8), "c_mid": (0.8, 0.87), "c_high": (0.9, 0.95), "c_bad": (0.6, 0.7)}
    speed = {"c_low": 3.0, "c_mid": 2.0, "c_high": 1.0, "c_bad": 0.5}
    candidate_items = {name: _fake_variant(rng, *acc, 1.0)[1] for name, acc in quality.items()}
    figures_, fit, select = {"length": 256, "bound_pair": "qwen3-v0", "maps": {}}, {"maps": {}}, {"maps": {}}
    for rank, name in enumerate(["c_bad", "c_low", "c_mid", "c_high"]):
        figures_["maps"][name] = {"family": "linear", "k": 1, "speedup": speed[name], "bound_at_pair": 2 * speed[name],
                                  "parameters": 10, "mapper_bytes": 100}
        fit["maps"][name] = {"r2_keys_select": 0.5 - 0.1 * rank, "r2_values_select": 0.5 - 0.1 * rank}
        select["maps"][name] = {"prompts": {"attention_cosine": 0.6 + 0.1 * rank, "agreement": 0.5,
                                            "mean_kl": 1.0 - 0.2 * rank, "confident_top1": 0.7 + 0.1 * rank,
                                            "confident_agreement": None, "oracle_weighted_agreement": 0.9 - 0.1 * rank}}
    study = candidates.compute(report_params(), measure_params(bootstrap_iters=200),
                               candidates.Inputs(items, candidate_items, figures_, fit, select))
    rows = study["rows"]
    assert rows["c_high"]["gap_closure"] > rows["c_mid"]["gap_closure"] > rows["c_low"]["gap_closure"]
    assert abs(rows["c_low"]["gap_closure"]) < 0.15 and rows["c_low"]["retention"] > 0.5  # as good as the source
    assert study["proxies"]["attention_cosine"]["rho"] == 1.0 and study["proxies"]["mean_kl"]["rho"] == -1.0
    assert study["proxies"]["r2_heldout"]["rho"] == -1.0  # here built to mislead: R² falls as retention rises
    assert np.isnan(study["proxies"]["agreement"]["rho"])  # the same for every candidate: no ranking
    confident = study["confident_proxies"]
    assert confident["confident_top1"]["rho"] == 1.0 and confident["oracle_weighted_agreement"]["rho"] == -1.0
    assert confident["confident_agreement"]["n"] == 0  # no confident select position: no candidate to rank
    assert [n for n, r in rows.items() if r["pareto_measured"]] == ["c_low", "c_mid", "c_high"]
    assert not rows["c_bad"]["pareto_at_pair"]
    text = render.section("candidates", study)
    assert "attention-output cosine (select) tracks retention most closely" in text
    assert "| confident-prompt top-1 (select) | +1.00" in text and "| 100.0% | 60.0% |" in text
    assert "On the front against the measured speedup: c_low, c_mid and c_high." in text
