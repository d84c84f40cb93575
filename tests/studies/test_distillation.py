"""The distillation study (`studies.distillation`): each map against its start on the same items, and the
section when no epoch beat the start."""
import numpy as np
import pandas as pd
import pytest
from helpers import measure_params
from helpers.report import _fake_variant, report_params

from pipeline.studies import distillation, render


def test_the_distillation_study_compares_each_map_with_its_start_on_the_same_items(tmp_path):
    rng = np.random.default_rng(3)
    items = {name: _fake_variant(rng, *spec)[1] for name, spec in
             {"oracle": (0.9, 0.95, 1.0), "source": (0.4, 0.6, 0.3), "lin": (0.45, 0.62, 0.5)}.items()}
    items["lin+kl"] = items["lin"].copy()
    better = (items["lin+kl"].index % 4 == 0) & (items["lin+kl"].acc == 0)  # a quarter of the misses fixed
    items["lin+kl"].loc[better, ["acc", "acc_norm"]] = 1.0
    curve = pd.DataFrame({"epoch": [0, 1, 2], "select_kl": [0.5, 0.4, 0.45], "select_agreement": [0.4, 0.5, 0.5]})
    facts = {"start": "lin", "best_epoch": 1, "epochs": 2, "steps": 8, "seconds": 3.0, "lr": 0.001, "kv_weight": 1.0,
             "probe_steps": 4, "probes": {"0.001": {"1": 0.42, "0.1": 0.44}, "0.01": {"1": None, "0.1": 0.6},
                                          "0.0001": {"1": 0.48, "0.1": 0.49}},
             "select_kl_start": 0.5, "select_kl": 0.4}
    cost = {"oracle": 1.0, "rows": 0.5, "mapped_step": 2.0, "map_update": 0.25, "select_scoring": 1.5}
    select = {"maps": {"lin": {"prompts": {"next_token_top1": 0.5, "agreement": 0.4, "rollout_agreement": 0.3,
                                           "mean_kl": 0.5}},
                       "lin+kl": {"prompts": {"next_token_top1": 0.6, "agreement": 0.5, "rollout_agreement": 0.4,
                                              "mean_kl": 0.4}}}}
    columns = {"lin": ([1, 0, 0, 0], [2, 1, 0, 1], [1.0, 1.0, 2.0, 2.0]),
               "lin+kl": ([1, 1, 0, 1], [4, 1, 2, 1], [0.5, 0.5, 1.0, 1.0])}  # top-1, rollout, KL per prompt
    prompts = {name: pd.DataFrame({"prompt": range(4), "first_agree": top1, "rollout_agree": rollout, "horizon": 4,
                                   "kl": kl, "tokens": 2}) for name, (top1, rollout, kl) in columns.items()}
    inputs = distillation.Inputs({"maps": {"lin+kl": facts}, "rows_fit": 10, "rows_select": 5, "cost_s": cost},
                                 {"lin+kl": curve},
                                 select, items, prompts)
    study = distillation.compute(report_params(), measure_params(), inputs)
    row = study["rows"]["lin+kl"]
    assert row["next_token_top1_before"] == 0.5 and row["next_token_top1_after"] == 0.6
    assert row["retention_after"] > row["retention_before"] and row["gap_closure_after"] > row["gap_closure_before"]
    assert row["tasks_diff"] == pytest.approx(better.sum() / len(better)) and 0 < row["tasks_low"] <= row["tasks_diff"]
    assert row["tasks_mcnemar_p"] < 1e-3 and row["tasks_n"] == len(better)
    assert row["eval_next_token_top1_before"] == 0.25 and row["eval_next_token_top1_after"] == 0.75
    assert row["eval_next_token_top1_diff"] == pytest.approx(0.5) and row["eval_next_token_top1_mcnemar_p"] == 0.5
    assert row["eval_rollout_agreement_diff"] == pytest.approx(0.25)
    assert row["eval_mean_kl_diff"] == pytest.approx(-0.375)
    assert row["eval_mean_kl_low"] <= -0.25 and row["eval_prompts"] == 4
    text = render.section("distillation", study)
    assert "| lin+kl | lin | 50.0% → 60.0% |" in text and "McNemar" in text and "| lin+kl | 25.0% → 75.0% |" in text
    assert ("| lin+kl | 0.5000 | 0.0001 × 0.1: 0.4900 · 0.0001 × 1: 0.4800 · 0.001 × 0.1: 0.4400 · "
            "**0.001 × 1: 0.4200** · 0.01 × 0.1: 0.6000 · 0.01 × 1: diverged | 0.001 | 1 |") in text
    assert "the start was kept" not in text and "the mapped step through the target (forward and backward) 2 s" in text
    tables = distillation.figure(study, tmp_path)
    assert (tmp_path / "distillation.png").is_file() and list(tables["distillation"].select_kl) == [0.5, 0.4, 0.45]
    del items["lin+kl"]  # the candidates study did not run: the select split's table alone
    alone = distillation.compute(report_params(), measure_params(),
                                 distillation.Inputs(inputs.distill, inputs.curves, select, items, {}))
    assert "tasks_diff" not in alone["rows"]["lin+kl"] and "McNemar" not in render.section("distillation", alone)


def test_the_distillation_study_says_when_no_epoch_beat_the_start_and_skips_the_table_without_probes():
    facts = {"start": "lin", "best_epoch": 0, "epochs": 3, "steps": 12, "seconds": 3.0, "lr": 0.001, "kv_weight": 0.1,
             "probe_steps": 0, "select_kl_start": 0.5, "select_kl": 0.5}  # one rate and one weight declared: no probe
    curve = pd.DataFrame({"epoch": [0, 1], "select_kl": [0.5, 0.6], "select_agreement": [0.4, 0.4]})
    cost = dict.fromkeys(["oracle", "rows", "mapped_step", "map_update", "select_scoring"], 1.0)
    inputs = distillation.Inputs({"maps": {"lin+kl": facts}, "rows_fit": 10, "rows_select": 5, "cost_s": cost},
                                 {"lin+kl": curve}, {"maps": {}}, {}, {})
    text = render.section("distillation", distillation.compute(report_params(), measure_params(), inputs))
    assert "lin+kl: distillation did not improve on the fitted map; the start was kept." in text
    assert "Rate × kv_weight → select KL" not in text
