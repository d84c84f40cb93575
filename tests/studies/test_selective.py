"""The selective study (`studies.selective`): the selected map's item AUROC with its interval and n and its
confident top-1, and metrics written before the confident figures refused."""
import pytest
from helpers import committed, measure_params
from helpers.selective import _summary_inputs

from pipeline.selective import summarize
from pipeline.store.artifacts import ArtifactError
from pipeline.store.params import parse
from pipeline.studies import render
from pipeline.studies import selective as study
from pipeline.studies.settings import ReportParams


def test_the_study_names_the_selected_maps_item_auroc_with_its_interval_and_n_and_draws_confident_top1(tmp_path):
    margins = [[0.9, 0.0], [0.5, 0.0], [0.1, 0.9], [0.3, 0.9], [0.05, 0.9], [0.25, 0.0]] * 5
    items, prompts, params, costs = _summary_inputs(margins)
    params.maps = {"a": "models/mapper.safetensors"}  # select's output: the selected map
    metrics, curves = summarize(items, prompts, params, costs, measure_params(bootstrap_iters=200))
    report = parse(ReportParams, committed("report"), "report")
    figures = study.compute(report, measure_params(), study.Inputs(metrics, curves))
    text = render.section("selective", figures)
    row = metrics["maps"]["a"]["scores"]["entropy"]
    auroc = f"{row['auroc_items']:.3f} [{row['auroc_items_low']:.3f}, {row['auroc_items_high']:.3f}]"
    assert (f"Selected map (`a`, models/mapper.safetensors): AUROC on the eval items entropy {auroc} (n = 40 items, "
            f"14 where the map changes the decision)") in text
    facts = metrics["maps"]["a"]
    assert facts["confident_top1_low"] < 0.75 < facts["confident_top1_high"]
    assert (f"| a | none (ungated) | — | 40 (14) | 50.0% | 75.0% [{100 * facts['confident_top1_low']:.1f}%, "
            f"{100 * facts['confident_top1_high']:.1f}%] (n = 20) |") in text
    study.figure(figures, tmp_path)
    assert (tmp_path / "selective.png").stat().st_size > 0 and (tmp_path / "selective_top1.png").stat().st_size > 0
    params.maps = {"a": "models/best/mapped_k1.safetensors"}  # not the selected map: no such sentence
    other = summarize(items, prompts, params, costs, measure_params(bootstrap_iters=200))[0]
    text = render.section("selective", study.compute(report, measure_params(), study.Inputs(other, curves)))
    assert "Selected map" not in text


def test_the_study_refuses_selective_metrics_written_before_the_confident_figures(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    metrics = tmp_path / "metrics" / "selective.json"
    metrics.parent.mkdir()
    metrics.write_text('{"target_retention": 0.99, "maps": {}}')
    with pytest.raises(ArtifactError, match="rerun the selective stage"):
        study.load(None)
