"""The prompt metrics' one table (`measure.prompt_metrics`): a new metric is one entry, and it reaches select's rule
and ranking and the report with no other file edited."""
import numpy as np
import pandas as pd
import pytest
import torch
from helpers import committed, measure_params, periodic_batch
from helpers.architectures import linear_copy_mapper

from pipeline.kv.mapper import save_mapper
from pipeline.kv.pair import Pair
from pipeline.measure.prompt_metrics import PROMPT_METRICS, PromptMetric, prompt_figures
from pipeline.schema.select import SelectParams
from pipeline.select import run
from pipeline.store import paths
from pipeline.store.artifacts import nested
from pipeline.store.params import parse
from pipeline.studies import candidates, render
from pipeline.studies.settings import ReportParams

MAPS = {"linear_k1_exact": (0.0, 0.9), "linear_k1_rough": (0.2, 0.8), "linear_k1_noisy": (0.5, 0.7)}  # noise, accuracy


def missed(rows: pd.DataFrame, margin: float) -> float:
    """The share of continuation positions where the variant's argmax is not the oracle's."""
    return float(1 - rows.agree.sum() / rows.tokens.sum())


@pytest.fixture
def registry(monkeypatch) -> PromptMetric:
    """The table with one more entry, for this test only: higher `missed` ranks first, so it prefers worse maps."""
    metric = PromptMetric("missed", "missed positions", True, missed, proxy=True)
    monkeypatch.setitem(PROMPT_METRICS, metric.name, metric)
    return metric


def test_every_entry_names_itself_and_the_rows_measure_every_entry_they_can(periodic_model):
    assert all(name == metric.name for name, metric in PROMPT_METRICS.items())
    rows = pd.DataFrame({"tokens": [2, 2], "nll": [1.0, 1.0], "first_agree": [1, 0], "agree": [2, 1],
                         "kl": [0.2, 0.6], "rollout_agree": [3, 1], "horizon": [4, 4]})
    figures = prompt_figures(rows, None)  # no margin: no confident figure; no attention outputs: no cosine
    assert set(figures) == {"perplexity", "next_token_top1", "agreement", "mean_kl", "rollout_agreement"}
    assert figures["agreement"] == 0.75 and figures["mean_kl"] == 0.2 and figures["rollout_agreement"] == 0.5


def test_a_new_prompt_metric_is_one_entry_that_reaches_selects_rule_and_ranking_and_the_report(
        registry, tmp_path, monkeypatch, periodic_model):
    monkeypatch.chdir(tmp_path)
    paths.MAPPERS.mkdir(parents=True)
    for name, (noise, _) in MAPS.items():
        save_mapper(linear_copy_mapper(periodic_model, noise, 1.0), paths.fitted_map(name))
    paths.DATA.mkdir()
    sequences = periodic_batch(torch.Generator().manual_seed(3), 6, 24, 32).tolist()
    pd.DataFrame({"token_ids": sequences}).to_parquet(paths.split("select"), index=False)
    params = parse(SelectParams, committed("select", rule="missed", top_k=32, horizon=4, repairs=["none"]), "select")
    metrics = nested(run(params, Pair.of(periodic_model, periodic_model), paths.map_candidates(), 0.2))
    figures = {name: metrics["maps"][name]["prompts"]["missed"] for name in MAPS}
    assert figures["linear_k1_exact"] < 0.01 < figures["linear_k1_rough"] < figures["linear_k1_noisy"]
    assert metrics["selected"] == "linear_k1_noisy"  # ranked by the new entry, in its direction
    # the report's candidates study correlates it with retention across the maps, and its table names it
    rng = np.random.default_rng(0)

    def items(accuracy: float) -> pd.DataFrame:
        frame = pd.DataFrame({"task": ["hellaswag"] * 200 + ["piqa"] * 200, "item": list(range(200)) * 2,
                              "acc": (rng.random(400) < accuracy).astype(float)})
        return frame.assign(acc_norm=frame.acc)

    inputs = candidates.Inputs(
        {"oracle": items(0.95), "source": items(0.6)}, {name: items(accuracy) for name, (_, accuracy) in MAPS.items()},
        {"length": 32, "bound_pair": "qwen3-v0", "maps": {name: {"family": "linear", "k": 1, "speedup": 1.0,
                                                                   "bound_at_pair": 2.0, "parameters": 10,
                                                                   "mapper_bytes": 100} for name in MAPS}},
        {"maps": {name: {"r2_keys_select": 0.5, "r2_values_select": 0.5} for name in MAPS}}, metrics)
    study = candidates.compute(parse(ReportParams, committed("report"), "report"), measure_params(bootstrap_iters=100),
                               inputs)
    assert study["rows"]["linear_k1_noisy"]["missed"] == figures["linear_k1_noisy"]
    assert study["proxies"]["missed"]["rho"] == -1.0 and study["proxies"]["missed"]["n"] == 3
    assert "| missed positions (select) | -1.00" in render.section("candidates", study)
