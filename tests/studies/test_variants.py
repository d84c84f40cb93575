"""Report arithmetic: retention exactly as PROTOCOL defines it, checked on V0's own figures."""
import json

import numpy as np
import pandas as pd
import pytest
from helpers import committed

from pipeline.measure.retention import gap_closure, mean_retention, prompt_gap_closure, retention
from pipeline.report import markdown
from pipeline.store.params import parse
from pipeline.studies import calibration, candidates, distillation, length, variants
from pipeline.studies.run import Run, pair_names
from pipeline.studies.settings import ReportParams
from pipeline.studies.variants import V0


def test_retention_reproduces_v0_headline():
    oracle = {"hellaswag": V0["oracle"][2], "piqa": V0["oracle"][3]}
    k1 = {"hellaswag": V0["mapped_k1"][2], "piqa": V0["mapped_k1"][3]}
    k4 = {"hellaswag": V0["mapped_k4"][2], "piqa": V0["mapped_k4"][3]}
    assert retention(0.546, 0.594, 0.25) == pytest.approx(0.8605, abs=1e-4)
    assert round(100 * mean_retention(k1, oracle), 1) == 85.1
    assert round(100 * mean_retention(k4, oracle), 1) == 76.4


def _fake_variant(rng, acc_hs, acc_pq, agree, n=300, prompts=60):
    items = pd.DataFrame({"task": ["hellaswag"] * n + ["piqa"] * n, "item": list(range(n)) * 2,
                          "acc": np.r_[rng.random(n) < acc_hs, rng.random(n) < acc_pq].astype(float)})
    items["acc_norm"] = items.acc
    prompt_rows = pd.DataFrame({"prompt": range(prompts), "first_agree": (rng.random(prompts) < agree).astype(int),
                                "tokens": 16})
    prompt_rows["nll"] = 16 * (2 - agree) - prompt_rows.first_agree  # no draw: the items' draws stay as they were
    metrics = {"prompts": {"perplexity": 10 / max(agree, 0.1), "next_token_top1": agree, "agreement": agree,
                           "mean_kl": 1 - agree, "rollout_agreement": agree, "n": prompts},
               "tasks": {task: {"acc": frame.acc.mean(), "acc_norm": frame.acc.mean(), "n": n, "kinds": {}}
                         for task, frame in items.groupby("task")}}
    return metrics, items, prompt_rows


def report_params(**overrides) -> ReportParams:
    return parse(ReportParams, committed("report", **overrides), "report")


def build(params: ReportParams, metrics: dict, items: dict, prompts: dict, controls: dict) -> dict:
    """The variants' study of a run that evaluated `metrics` (the pair and the other studies' files unused)."""
    run = Run(metrics, items, prompts, skipped={}, controls=controls, select={}, latency=None,
              pair=("models/source", "models/target"), calibration_sizes=[], operating_lengths=[])
    return variants.compute(params, run)


def test_criteria_follow_the_numbers():
    rng = np.random.default_rng(0)
    spec = {"oracle": (0.9, 0.95, 1.0), "selected": (0.85, 0.9, 0.9), "source": (0.4, 0.6, 0.3),
            "zero": (0.25, 0.5, 0.05), "shuffled": (0.3, 0.5, 0.1)}
    metrics, items, prompts = {}, {}, {}
    for name, args in spec.items():
        metrics[name], items[name], prompts[name] = _fake_variant(rng, *args)
    controls = {"compatibility": {"passed": True}}
    report = build(report_params(criteria={"noninferiority_margin": 0.2}), metrics, items, prompts, controls)
    criteria = report["criteria"]
    assert criteria["beats_source_and_nulls"]["passed"] and criteria["controls_passed"]["passed"]
    assert criteria["retention_floor"]["passed"] and criteria["noninferiority"]["passed"]
    assert report["variants"]["oracle"]["retention"] == pytest.approx(1.0)
    broken = build(report_params(), metrics, items, prompts, {"compatibility": {"passed": False}})
    assert not broken["criteria"]["controls_passed"]["passed"]
    metrics["source"], items["source"], prompts["source"] = _fake_variant(rng, 0.85, 0.9, 0.9)
    assert not build(report_params(), metrics, items, prompts, controls)["criteria"]["beats_source_and_nulls"]["passed"]


def test_gap_closure_is_the_share_of_the_source_to_oracle_gap_a_variant_closes():
    assert gap_closure(0.6, 0.5, 0.75) == pytest.approx(0.4)
    assert gap_closure(0.5, 0.5, 0.75) == 0.0 and gap_closure(0.75, 0.5, 0.75) == 1.0
    assert gap_closure(0.45, 0.5, 0.75) == pytest.approx(-0.2)  # worse than the source alone
    assert np.isnan(gap_closure(0.6, 0.7, 0.7))  # the oracle does not beat the source: no gap to close


def _study(rng, selected):
    spec = {"oracle": (0.9, 0.95, 1.0), "selected": selected, "source": (0.7, 0.8, 0.3)}
    metrics, items, prompts = {}, {}, {}
    for name, args in spec.items():
        metrics[name], items[name], prompts[name] = _fake_variant(rng, *args)
    return metrics, items, prompts


def test_the_oracle_closes_the_whole_gap_the_source_none_and_the_criterion_reads_the_selected_map():
    controls = {"compatibility": {"passed": True}}
    report = build(report_params(), *_study(np.random.default_rng(2), (0.85, 0.9, 0.9)), controls)
    v = report["variants"]
    assert (v["oracle"]["gap_closure"], v["oracle"]["gap_closure_low"], v["oracle"]["gap_closure_high"]) == (1, 1, 1)
    assert (v["source"]["gap_closure"], v["source"]["gap_closure_low"], v["source"]["gap_closure_high"]) == (0, 0, 0)
    chosen = v["selected"]
    assert chosen["gap_closure_low"] < chosen["gap_closure"] < chosen["gap_closure_high"]
    assert 0.3 < chosen["gap_closure"] < 1.0 and chosen["retention"] > chosen["gap_closure"]
    assert report["criteria"]["gap_closure_floor"] == {"passed": True, "threshold": 0.5,
                                                    "measured": chosen["gap_closure"], "metric": "tasks"}
    # a map no better than the source model alone keeps most of the retention but closes none of the gap
    near_source = build(report_params(), *_study(np.random.default_rng(2), (0.7, 0.8, 0.3)), controls)
    weak = near_source["variants"]["selected"]
    assert weak["retention"] > 0.5 and abs(weak["gap_closure"]) < 0.15
    assert not near_source["criteria"]["gap_closure_floor"]["passed"]


def test_without_the_source_baseline_there_is_no_gap_closure_and_its_criterion_does_not_pass():
    metrics, items, prompts = _study(np.random.default_rng(3), (0.85, 0.9, 0.9))
    for table in (metrics, items, prompts):
        del table["source"]
    report = build(report_params(), metrics, items, prompts, {"compatibility": {"passed": True}})
    assert report["variants"]["selected"]["gap_closure"] is None
    assert report["criteria"]["gap_closure_floor"] == {"passed": False, "threshold": 0.5, "measured": None,
                                                    "metric": "tasks"}


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
    study = candidates.compute(report_params(bootstrap_iters=200),
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
    text = "\n".join(candidates.lines(study))
    assert "attention-output cosine (select) tracks retention most closely" in text
    assert "| confident-prompt top-1 (select) | +1.00" in text and "| 100.0% | 60.0% |" in text
    assert "On the front against the measured speedup: c_low, c_mid and c_high." in text


def test_the_calibration_curve_names_the_size_from_which_the_larger_k_pays_off():
    rng = np.random.default_rng(5)
    items = {name: _fake_variant(rng, *acc, 1.0)[1] for name, acc in {"oracle": (0.9, 0.95),
                                                                     "source": (0.6, 0.7)}.items()}
    # k=3 overfits the small calibration sets and overtakes k=1 from 50 sequences on
    accuracy = {10: {"linear_k1_lam0.001": (0.75, 0.8), "linear_k3_lam0.001": (0.5, 0.6)},
                25: {"linear_k1_lam0.001": (0.75, 0.8), "linear_k3_lam0.001": (0.75, 0.8)},
                50: {"linear_k1_lam0.001": (0.75, 0.8), "linear_k3_lam0.001": (0.88, 0.93)},
                100: {"linear_k1_lam0.001": (0.76, 0.81), "linear_k3_lam0.001": (0.9, 0.95)}}
    point_items = {size: {name: _fake_variant(rng, *acc, 1.0)[1] for name, acc in by_name.items()}
                   for size, by_name in accuracy.items()}
    points = {size: {"tokens": 100 * size, "maps": {name: {"family": "linear", "k": int(name[8]),
                                                           "params_per_token": 1.0 / size} for name in accuracy[size]}}
              for size in accuracy}
    study = calibration.compute(report_params(bootstrap_iters=300), calibration.Inputs(items, points, point_items))
    assert len(study["rows"]) == 8 and study["rows"][0]["tokens"] == 1000
    by_size = study["larger_k"]["by_size"]
    assert by_size[10]["high"] < 0 and by_size[100]["low"] > 0
    assert study["larger_k"]["larger"] == "linear_k3_lam0.001" and study["larger_k_pays_from"] == 50
    assert "pays off (interval above 0 at this size and every larger one) from 50 sequences on" in \
        "\n".join(calibration.lines(study))


def test_without_a_calibration_size_the_section_says_so_and_the_declared_plot_files_are_written(tmp_path):
    study = calibration.compute(report_params(), calibration.Inputs({}, {}, {}))
    assert study["rows"] == [] and study["larger_k"] is None and study["larger_k_pays_from"] is None
    assert "No calibration point in this profile" in "\n".join(calibration.lines(study))
    tables = calibration.figure(study, tmp_path)  # dvc.yaml declares plots/calibration.csv and the figure
    assert list(tables["calibration"].columns) == calibration.COLUMNS and tables["calibration"].empty
    assert (tmp_path / "calibration.png").stat().st_size > 0


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
    study = length.compute(report_params(bootstrap_iters=300), length.Inputs(figures_, rows, tasks))
    short, long = study["rows"]
    assert short["nll_sign_test"]["p"] > 0.01 and long["nll_sign_test"]["lower"] == 40
    assert long["agreement_diff"]["low"] > 0
    assert [b["bin"] for b in study["task_bins"]] == ["1-2x", "2-4x"] and study["task_bins"][1]["diff"]["low"] > 0
    assert "| 2-4x | 50 |" in "\n".join(length.lines(study))


def test_a_variant_the_contract_skipped_is_named_with_its_reason_and_not_compared(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "metrics/eval").mkdir(parents=True)
    for name, args in {"oracle": (0.9, 0.95, 1.0), "selected": (0.85, 0.9, 0.9)}.items():
        metrics, items, prompt_rows = _fake_variant(rng, *args)
        (tmp_path / "eval" / name).mkdir(parents=True)
        items.to_parquet(tmp_path / "eval" / name / "items.parquet")
        prompt_rows.to_parquet(tmp_path / "eval" / name / "prompts.parquet")
        (tmp_path / "metrics/eval" / f"{name}.json").write_text(json.dumps(metrics))
    reason = "direct injection needs equal KV geometry, but ..."
    (tmp_path / "metrics/eval/direct.json").write_text(json.dumps({"skipped": reason}))
    (tmp_path / "metrics/controls.json").write_text(json.dumps({"compatibility": {"passed": True}}))
    run = Run.load(["oracle", "direct", "selected"], [], [])
    assert run.skipped == {"direct": reason} and set(run.metrics) == {"oracle", "selected"}
    report = variants.compute(report_params(), run)
    context = {"profile": "llama-shapes", "data_kind": "generated", "source": "s", "target": "t",
               "dtype": "bfloat16", "device": "cpu", "environment": {}, "pair": run.pair, "selected_name": "selected"}
    text = markdown(report, run, context)
    assert f"Not run for this pair: Direct source-cache injection — {reason}." in text
    assert "| Direct source-cache injection |" not in text


def _head(tmp_path, monkeypatch, pointers: dict[str, dict], profile: str = "qwen3-v0") -> str:
    """The report's head for a run whose models/<side> holds `pointers` (kind -> pointer file), on fake numbers."""
    monkeypatch.chdir(tmp_path)
    for side, pointer in pointers.items():
        (tmp_path / "models" / side).mkdir(parents=True)
        (tmp_path / "models" / side / f"{pointer['kind']}.json").write_text(
            json.dumps({k: v for k, v in pointer.items() if k != "kind"}))
    report = build(report_params(), *_study(np.random.default_rng(7), (0.85, 0.9, 0.9)),
                   {"compatibility": {"passed": True}})
    context = {"profile": profile, "data_kind": "hub", "source": "s", "target": "t", "dtype": "bfloat16",
               "device": "cuda", "pair": pair_names(), "selected_name": "selected"}
    return "\n".join(variants.lines(report, context))


def test_the_v0_reference_column_appears_only_for_v0s_pair(tmp_path, monkeypatch):
    text = _head(tmp_path, monkeypatch, {"source": {"kind": "hub", "id": "Qwen/Qwen3-0.6B", "revision": "0123abc"},
                                         "target": {"kind": "hub", "id": "Qwen/Qwen3-1.7B", "revision": "4567def"}},
                 profile="my-rerun")
    assert "| Gap closure [95% CI] | V0 reference |" in text
    assert "| 15.2157 / 100.0% / 59.4% / 74.0% (Δ " in text and "— deltas shown" in text
    assert "this run's pair is" not in text


def test_a_qwen3_v0_profile_on_other_checkpoints_names_its_pair_and_leaves_the_v0_column_out(tmp_path, monkeypatch):
    small, large = tmp_path / "ckpt" / "SmolLM2-135M", tmp_path / "ckpt" / "SmolLM2-360M"
    small.mkdir(parents=True)
    large.mkdir(parents=True)
    text = _head(tmp_path, monkeypatch, {"source": {"kind": "local", "path": str(small), "sha256": "0" * 64},
                                         "target": {"kind": "local", "path": str(large), "sha256": "1" * 64}})
    assert "V0 reference" not in text and "15.2157" not in text and "Δ -" not in text
    # the run's own working directory holds the folders: the report names them relative to it, not by absolute path
    assert "this run's pair is `ckpt/SmolLM2-135M` → `ckpt/SmolLM2-360M`, so they are not shown." in text


def test_the_tiny_pair_and_random_shapes_are_not_v0s_pair_either(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert pair_names() == ("models/source", "models/target")  # nothing prepared: the trained tiny pair
    assert not variants.is_v0_pair(pair_names())
    text = _head(tmp_path, monkeypatch, {"source": {"kind": "random", "shape": "qwen3-0.6b", "seed": 0},
                                         "target": {"kind": "random", "shape": "qwen3-1.7b", "seed": 1}})
    assert "V0 reference" not in text
    assert "this run's pair is `shape:qwen3-0.6b` → `shape:qwen3-1.7b`" in text


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
    study = distillation.compute(report_params(), inputs)
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
    text = "\n".join(distillation.lines(study))
    assert "| lin+kl | lin | 50.0% → 60.0% |" in text and "McNemar" in text and "| lin+kl | 25.0% → 75.0% |" in text
    assert ("| lin+kl | 0.5000 | 0.0001 × 0.1: 0.4900 · 0.0001 × 1: 0.4800 · 0.001 × 0.1: 0.4400 · "
            "**0.001 × 1: 0.4200** · 0.01 × 0.1: 0.6000 · 0.01 × 1: diverged | 0.001 | 1 |") in text
    assert "the start was kept" not in text and "the mapped step through the target (forward and backward) 2 s" in text
    tables = distillation.figure(study, tmp_path)
    assert (tmp_path / "distillation.png").is_file() and list(tables["distillation"].select_kl) == [0.5, 0.4, 0.45]
    del items["lin+kl"]  # the candidates study did not run: the select split's table alone
    alone = distillation.compute(report_params(), distillation.Inputs(inputs.distill, inputs.curves, select, items, {}))
    assert "tasks_diff" not in alone["rows"]["lin+kl"] and "McNemar" not in "\n".join(distillation.lines(alone))


def test_the_distillation_study_says_when_no_epoch_beat_the_start_and_skips_the_table_without_probes():
    facts = {"start": "lin", "best_epoch": 0, "epochs": 3, "steps": 12, "seconds": 3.0, "lr": 0.001, "kv_weight": 0.1,
             "probe_steps": 0, "select_kl_start": 0.5, "select_kl": 0.5}  # one rate and one weight declared: no probe
    curve = pd.DataFrame({"epoch": [0, 1], "select_kl": [0.5, 0.6], "select_agreement": [0.4, 0.4]})
    cost = dict.fromkeys(["oracle", "rows", "mapped_step", "map_update", "select_scoring"], 1.0)
    inputs = distillation.Inputs({"maps": {"lin+kl": facts}, "rows_fit": 10, "rows_select": 5, "cost_s": cost},
                                 {"lin+kl": curve}, {"maps": {}}, {}, {})
    text = "\n".join(distillation.lines(distillation.compute(report_params(), inputs)))
    assert "lin+kl: distillation did not improve on the fitted map; the start was kept." in text
    assert "Rate × kv_weight → select KL" not in text


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


def test_the_gap_closure_criterion_reads_the_measure_declared_in_params_and_a_wide_task_interval_is_named():
    rng = np.random.default_rng(0)
    metrics, items, prompts = {}, {}, {}
    for name, args in {"oracle": (0.9, 0.95, 1.0), "selected": (0.5, 0.6, 0.8), "source": (0.45, 0.6, 0.3)}.items():
        metrics[name], items[name], prompts[name] = _fake_variant(rng, *args, n=40)
    controls = {"compatibility": {"passed": True}}
    report = build(report_params(gap_closure_metric="next_token_top1"), metrics, items, prompts, controls)
    chosen, criterion = report["variants"]["selected"], report["criteria"]["gap_closure_floor"]
    assert criterion["metric"] == "next_token_top1" and criterion["measured"] == chosen["gap_closure_next_token_top1"]
    assert criterion["measured"] != chosen["gap_closure"]
    report["gap_closure_metric"] = "next_token_top1"
    chosen.update(gap_closure_low=-2.5, gap_closure_high=-1.2)  # wide but decided: far below the source alone
    assert "Too wide" not in "\n".join(variants._gap_lines(report))
    chosen.update(gap_closure_low=-1.5, gap_closure_high=0.9)  # around 0 and wider than the whole gap
    text = "\n".join(variants._gap_lines(report))
    assert "reads `next_token_top1`" in text and "Too wide to decide anything" in text


def test_a_repaired_variant_is_its_own_row_after_the_selected_map_its_setting_in_the_label(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    metrics, items, prompts = {}, {}, {}
    for name, args in {"oracle": (0.9, 0.95, 1.0), "selected": (0.8, 0.85, 0.7), "source": (0.5, 0.6, 0.4),
                       "selected_repaired": (0.85, 0.9, 0.8)}.items():
        metrics[name], items[name], prompts[name] = _fake_variant(rng, *args)
    metrics["selected_repaired"]["repair"] = "layers:1+tokens:0.09:deviation"
    report = build(report_params(), metrics, items, prompts, {"compatibility": {"passed": True}})
    context = {"profile": "tiny", "data_kind": "generated", "source": "s", "target": "t", "dtype": "float32",
               "device": "cpu", "pair": ("models/source", "models/target"), "selected_name": "selected"}
    table = [line for line in variants.lines(report, context) if line.startswith("| ")]
    names = [line.split(" | ")[0][2:] for line in table[:5]]
    assert names[2:4] == ["Selected mapped transfer",
                          "Selected mapped transfer, repaired (`layers:1+tokens:0.09:deviation`)"]
    assert report["variants"]["selected_repaired"]["repair"] == "layers:1+tokens:0.09:deviation"


def test_v0s_rows_and_their_comparisons_come_from_each_variants_map_not_from_its_name():
    rng = np.random.default_rng(8)
    spec = {"oracle": (0.9, 0.95, 1.0), "selected": (0.8, 0.85, 0.7), "source": (0.5, 0.6, 0.4),
            "v0_small": (0.7, 0.8, 0.6), "v0_large": (0.75, 0.8, 0.6), "trained": (0.8, 0.85, 0.7)}
    metrics, items, prompts = {}, {}, {}
    for name, args in spec.items():
        metrics[name], items[name], prompts[name] = _fake_variant(rng, *args)
    facts = {"v0_small": (1, False, True), "v0_large": (4, False, True), "trained": (1, True, False),
             "selected": (1, True, False)}  # k, distilled, select's best closed-form map of its k
    for name, (k, distilled, best) in facts.items():
        metrics[name]["map"] = {"family": "linear", "k": k, "distilled": distilled, "best_of_k": best}
    report = build(report_params(), metrics, items, prompts, {"compatibility": {"passed": True}})
    assert {"k1_minus_k4", "trained_minus_v0_small"} <= set(report["comparisons"])
    entries = report["variants"]
    assert [variants.label(name, entries[name]) for name in ("v0_small", "v0_large", "trained", "selected")] == [
        "Learned mapped transfer, k=1", "Learned mapped transfer, k=4", "Distilled mapped transfer, k=1",
        "Selected mapped transfer"]  # a named role keeps its name whatever its map
    assert variants.order(entries)[:4] == ["oracle", "v0_small", "v0_large", "selected"]
    assert "k=1 vs k=4: " in variants.reading(report, "selected")
