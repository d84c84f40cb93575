"""The variants study (`studies.variants`) on fake figures: the criteria follow the numbers, gap closure and its
criterion, the V0 reference column only for V0's pair, and each variant's row and comparisons from its map."""
import json

import numpy as np
import pytest
from helpers import measure_params
from helpers.report import _fake_variant, report_params

from pipeline.studies import render, variants
from pipeline.studies.run import Run, pair_names
from pipeline.studies.settings import ReportParams


def context(**changes) -> dict:
    """The report's context of a tiny run (the head's words read it), with `changes`."""
    return {"profile": "tiny", "data_kind": "generated", "source": "s", "target": "t", "dtype": "float32",
            "device": "cpu", "pair": ("models/source", "models/target"), "selected_name": "selected", **changes}


def build(params: ReportParams, metrics: dict, items: dict, prompts: dict, controls: dict) -> dict:
    """The variants' study of a run that evaluated `metrics` (the pair and the other studies' files unused)."""
    run = Run(metrics, items, prompts, skipped={}, controls=controls, select={}, latency=None,
              pair=("models/source", "models/target"), calibration_sizes=[], operating_lengths=[])
    return variants.compute(params, measure_params(), run)


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


def _head(tmp_path, monkeypatch, pointers: dict[str, dict], profile: str = "qwen3-v0") -> str:
    """The report's head for a run whose models/<side> holds `pointers` (kind -> pointer file), on fake numbers."""
    monkeypatch.chdir(tmp_path)
    for side, pointer in pointers.items():
        (tmp_path / "models" / side).mkdir(parents=True)
        (tmp_path / "models" / side / f"{pointer['kind']}.json").write_text(
            json.dumps({k: v for k, v in pointer.items() if k != "kind"}))
    report = build(report_params(), *_study(np.random.default_rng(7), (0.85, 0.9, 0.9)),
                   {"compatibility": {"passed": True}})
    return render.head(report, context(profile=profile, data_kind="hub", dtype="bfloat16", device="cuda",
                                       pair=pair_names()))


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
    assert pair_names() != variants.V0_PAIR
    text = _head(tmp_path, monkeypatch, {"source": {"kind": "random", "shape": "qwen3-0.6b", "seed": 0},
                                         "target": {"kind": "random", "shape": "qwen3-1.7b", "seed": 1}})
    assert "V0 reference" not in text
    assert "this run's pair is `shape:qwen3-0.6b` → `shape:qwen3-1.7b`" in text


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
    assert "Too wide" not in render.head(report, context())
    chosen.update(gap_closure_low=-1.5, gap_closure_high=0.9)  # around 0 and wider than the whole gap
    text = render.head(report, context())
    assert "reads `next_token_top1`" in text and "Too wide to decide anything" in text


def test_a_repaired_variant_is_its_own_row_after_the_selected_map_its_setting_in_the_label(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    metrics, items, prompts = {}, {}, {}
    for name, args in {"oracle": (0.9, 0.95, 1.0), "selected": (0.8, 0.85, 0.7), "source": (0.5, 0.6, 0.4),
                       "selected_repaired": (0.85, 0.9, 0.8)}.items():
        metrics[name], items[name], prompts[name] = _fake_variant(rng, *args)
    metrics["selected_repaired"]["repair"] = "layers:1+tokens:0.09:deviation"
    report = build(report_params(), metrics, items, prompts, {"compatibility": {"passed": True}})
    table = [line for line in render.head(report, context()).splitlines() if line.startswith("| ")]
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
    assert "k=1 vs k=4: " in render.head(report, context())


def test_a_new_modes_variant_is_a_row_by_its_name_until_the_report_gives_it_words_and_a_place(monkeypatch):
    figures = {name: {} for name in ("zero", "source", "selected", "fake", "direct", "oracle")}
    figures["linear_k1"] = {"map": {"best_of_k": True, "k": 1}}
    assert variants.order(figures) == ["oracle", "direct", "linear_k1", "selected", "source", "zero", "fake"]
    assert variants.label("fake") == "fake" and "fake" not in variants.RIVALS
    monkeypatch.setitem(variants.MODE_ROWS, "fake", ("Null control: a fake cache", 2))
    monkeypatch.setitem(variants.RIVALS, "fake", "the fake null")
    assert variants.order(figures) == ["oracle", "direct", "fake", "linear_k1", "selected", "source", "zero"]
    assert variants.label("fake") == "Null control: a fake cache"
    assert list(variants.RIVALS) == ["source", "zero", "shuffled", "direct", "fake"]
