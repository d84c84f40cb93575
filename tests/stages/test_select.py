"""Stage select: the rule picks the candidate that agrees with the oracle, and the best lambda per k; with repair
settings it chooses (map, setting) within the declared budget, on the select split alone; a rule naming no prompt
metric or a malformed repair is refused."""
import json

import pandas as pd
import pytest
import torch
from helpers import committed, periodic_batch
from helpers.architectures import linear_copy_mapper

from pipeline.kv.flops import lookahead_macs, repair_budget, target_prefill_macs
from pipeline.kv.mapper import save_mapper
from pipeline.kv.pair import Pair
from pipeline.kv.repair import Repair
from pipeline.kv.speculative import SpeculativeParams
from pipeline.schema.select import SelectParams
from pipeline.select import (
    budgets,
    choose,
    confident_scores,
    run,
    score_candidates,
    select_prompts,
)
from pipeline.store import paths
from pipeline.store.params import ParamError, parse
from pipeline.store.shapes import bound_configs


def test_select_picks_the_mapper_that_agrees_with_the_oracle(tmp_path, periodic_model):
    paths = []
    for name, noise, lam in (("linear_k1_noisy", 0.5, 0.1), ("linear_k1_exact", 0.0, 1.0),
                             ("linear_k1_rough", 0.2, 10.0)):
        paths.append(tmp_path / f"{name}.safetensors")
        save_mapper(linear_copy_mapper(periodic_model, noise, lam), paths[-1])
    sequences = periodic_batch(torch.Generator().manual_seed(3), 8, 30, 32).tolist()
    params = parse(SelectParams, committed("select", top_k=32, horizon=4, repairs=["none"], prompt_fraction=0.6),
                   "select")
    prompts = select_prompts(sequences, params)
    reference, scores, *_ = score_candidates(Pair.of(periodic_model, periodic_model), prompts, params, paths, 0.2)
    oracle = {**reference.prompts.metrics, **reference.prompts.counts}
    chosen, best_per_k = choose(scores, params.rule, params.max_recompute)
    assert chosen["name"] == "linear_k1_exact" and best_per_k[1]["name"] == "linear_k1_exact"
    exact = next(s for s in scores if s["name"] == "linear_k1_exact")
    assert exact["agreement"] > 0.99 and abs(exact["ppl_ratio"] - 1) < 1e-3
    assert min(s["agreement"] for s in scores) < exact["agreement"]
    assert exact["attention_cosine"] > 0.999 and oracle["attention_cosine"] == pytest.approx(1.0, abs=1e-5)
    assert choose(scores, "attention_cosine", params.max_recompute)[0]["name"] == "linear_k1_exact"
    assert min(s["attention_cosine"] for s in scores) < 0.99  # the noisy maps' attention drifts from the oracle's
    assert exact["confident_top1"] == 1.0 and oracle["confident_top1"] == 1.0 and oracle["confident_prompts"] > 0
    assert exact["oracle_weighted_agreement"] == pytest.approx(oracle["oracle_weighted_agreement"], abs=1e-3)
    assert min(s["oracle_weighted_agreement"] for s in scores) < exact["oracle_weighted_agreement"]
    assert choose(scores, "confident_agreement", params.max_recompute)[0]["name"] == "linear_k1_exact"


def score(name: str, agreement: float, perplexity: float = 3.0, parameters: int = 1, distilled: bool = False,
          repair: str = "none", budget: float = 0.0, confident_top1: float | None = 1.0) -> dict:
    """A hand-made candidate score of the linear family at k=1."""
    return dict(name=name, agreement=agreement, perplexity=perplexity, parameters=parameters, family="linear", k=1,
                distilled=distilled, repair=repair, budget=budget, confident_top1=confident_top1)


def test_a_rule_may_name_confident_top1_which_near_ties_do_not_decide():
    scores = [score("ties", 0.6, confident_top1=0.8), score("sure", 0.5, confident_top1=1.0),
              score("rough", 0.4, confident_top1=1.0, perplexity=4.0)]
    assert choose(scores, "agreement", 0.1)[0]["name"] == "ties"
    assert choose(scores, "confident_top1", 0.1)[0]["name"] == "sure"  # tie with rough: lower perplexity


def test_a_confident_rule_over_no_confident_prompt_is_refused_naming_the_margin():
    scores = [score("a", 0.5, confident_top1=None), score("b", 0.6, confident_top1=None)]
    with pytest.raises(ParamError, match=r"^select\.rule confident_top1: .* measure\.confident_margin 0\.9"):
        confident_scores(scores, "confident_top1", 0.9)
    confident_scores(scores, "agreement", 0.9)  # a rule that does not read them is not refused


def test_ties_go_to_lower_perplexity():
    scores = [score("a", 0.5, perplexity=3.0, parameters=1), score("b", 0.5, perplexity=2.0, parameters=9)]
    assert choose(scores, "agreement", 0.1)[0]["name"] == "b"


def test_a_distilled_linear_map_may_be_selected_but_the_best_per_k_stays_closed_form():
    scores = [score("linear_k1_lam1", 0.5), score("linear_k1_lam1+kl", 0.7, perplexity=2.0, distilled=True)]
    chosen, best_per_k = choose(scores, "agreement", 0.1)
    assert chosen["name"] == "linear_k1_lam1+kl" and best_per_k[1]["name"] == "linear_k1_lam1"


def test_a_setting_over_max_recompute_is_never_chosen_however_well_it_scores():
    scores = [score("a", 0.5), score("a", 0.9, repair="tokens:0.2:attention", budget=0.2),
              score("a", 0.6, repair="layers:1", budget=0.003)]
    assert choose(scores, "agreement", 0.1)[0]["repair"] == "layers:1"
    assert choose(scores, "agreement", 0.25)[0]["repair"] == "tokens:0.2:attention"
    assert choose(scores, "agreement", 0.0)[0]["repair"] == "none"


def test_a_tie_between_settings_goes_to_the_smaller_budget_and_v0s_best_per_k_stays_unrepaired():
    scores = [score("a", 0.5), score("a", 0.9, repair="tokens:0.09:recency", budget=0.09),
              score("a", 0.9, repair="layers:1", budget=0.003)]
    chosen, best_per_k = choose(scores, "agreement", 0.1)
    assert chosen["repair"] == "layers:1" and best_per_k[1]["repair"] == "none"


@pytest.mark.parametrize("repairs, message", [
    (["none", "tokens:0.1:nearest"], r"^select\.repairs: repair 'tokens:0\.1:nearest': bad part"),
    (["none", "layers:1", "layers:1"], r"^select\.repairs: a setting is named twice"),
    (["layers:1"], r"^select\.repairs: add `none`"),
])
def test_a_malformed_select_repair_is_refused_in_one_line_naming_the_key(repairs, message):
    with pytest.raises(ParamError, match=message):
        parse(SelectParams, committed("select", repairs=repairs), "select")


@pytest.fixture
def select_folder(tmp_path, monkeypatch, periodic_model):
    """A working folder with the select split and three candidate maps (exact, noisy, rough) of `periodic_model`."""
    monkeypatch.chdir(tmp_path)
    paths.MAPPERS.mkdir(parents=True)
    for name, noise, lam in (("linear_k1_noisy", 0.5, 0.1), ("linear_k1_exact", 0.0, 1.0),
                             ("linear_k1_rough", 0.2, 10.0)):
        save_mapper(linear_copy_mapper(periodic_model, noise, lam), paths.fitted_map(name))
    paths.DATA.mkdir()
    sequences = periodic_batch(torch.Generator().manual_seed(3), 6, 24, 32).tolist()
    pd.DataFrame({"token_ids": sequences}).to_parquet(paths.split("select"), index=False)
    return Pair.of(periodic_model, periodic_model)


def promoted() -> tuple[bytes, dict]:
    return paths.SELECTED_MAPPER.read_bytes(), json.loads(paths.SELECTED_REPAIR.read_text())


def test_with_repairs_none_select_scores_the_maps_alone_and_promotes_the_best_maps_own_bytes(select_folder):
    params = parse(SelectParams, committed("select", top_k=32, horizon=4, repairs=["none"]), "select")
    metrics = run(params, select_folder, paths.map_candidates(), 0.2)
    assert metrics["selected"] == "linear_k1_exact" and "repaired/" not in "".join(metrics)
    oracle = metrics["oracle"]["prompts"]
    assert metrics["maps/linear_k1_exact"]["prompts"]["confident_top1"] == 1.0 and oracle["confident_prompts"] > 0
    assert 0 < oracle["confident_position_share"] <= 1
    assert "oracle_weighted_agreement" in metrics["maps/linear_k1_noisy"]["prompts"]
    assert len(oracle["attention_cosine_layers"]) == select_folder.target.config.num_hidden_layers
    assert promoted() == (paths.fitted_map("linear_k1_exact").read_bytes(),
                          {"map": "linear_k1_exact", "repair": "none", "budget": 0.0})
    over = parse(SelectParams, committed("select", top_k=32, horizon=4, repairs=["none", "tokens:1:recency"],
                                         max_recompute=0.5), "select")
    assert run(over, select_folder, paths.map_candidates(), 0.2)["selected_repair"] == "none"  # 1.0 > 0.5: not scored
    assert promoted()[0] == paths.fitted_map("linear_k1_exact").read_bytes()


def test_the_best_maps_are_scored_at_each_setting_and_the_choice_reads_only_the_select_split(select_folder):
    params = parse(SelectParams, committed("select", top_k=32, horizon=4, repair_maps=2, max_recompute=1.0,
                                           repairs=["none", "sink:255", "layers:1"]), "select")
    first = run(params, select_folder, paths.map_candidates(), 0.2)
    repaired = {"/".join(key.split("/")[1:3]) for key in first if key.startswith("repaired/")}
    assert repaired == {f"{name}/{setting}" for name in ("linear_k1_exact", "linear_k1_rough")
                        for setting in ("sink:255", "layers:1")}
    # every prefix token recomputed: the oracle
    assert first["repaired/linear_k1_rough/sink:255"]["prompts"]["agreement"] == pytest.approx(1.0)
    before = promoted()
    pd.DataFrame({"token_ids": [[1, 2, 3]] * 4}).to_parquet(paths.split("eval"), index=False)
    assert run(params, select_folder, paths.map_candidates(), 0.2) == first and promoted() == before


def test_a_setting_ranking_by_the_source_is_scored_and_promoted_with_the_look_ahead_settings_it_read(select_folder):
    lookahead = parse(SpeculativeParams, committed("speculative", last=3, sinks=1), "speculative")
    params = parse(SelectParams, committed("select", top_k=32, horizon=4, max_recompute=1.0,
                                           repairs=["none", "tokens:0.9:source_attention"]), "select")
    with pytest.raises(ValueError, match=r"give the declared `speculative` settings"):
        budgets(params, select_folder.configs)
    source, target = bound_configs(params.bound_pair, select_folder.configs)
    costs = budgets(params, select_folder.configs, lookahead)
    plain = repair_budget(target, Repair.parse("tokens:0.9:source_attention"), params.length, 0)
    assert costs["tokens:0.9:source_attention"] == pytest.approx(
        plain + lookahead_macs(source, lookahead, params.length) / target_prefill_macs(target, params.length))
    params = params.model_copy(update={"lookahead": []})
    metrics = run(params, select_folder, [paths.fitted_map("linear_k1_noisy")], 0.2, declared=lookahead)
    assert metrics["selected_repair"] == "tokens:0.9:source_attention"  # 90% recomputed beats the noisy map alone
    assert promoted()[1]["speculative"] == lookahead.model_dump()
    assert json.loads(paths.LOOKAHEAD.read_text()) == lookahead.model_dump()  # [] : the declared settings as they are


def test_the_look_ahead_setting_best_by_the_rule_is_chosen_written_and_read_by_a_repair_ranking_by_the_source(
        select_folder):
    declared = parse(SpeculativeParams, committed("speculative", last=2, sinks=1), "speculative")
    params = parse(SelectParams, committed("select", top_k=32, horizon=4, max_recompute=1.0, lookahead_share=0.3,
                                           repairs=["none", "tokens:0.9:source_attention"], lookahead=[
                                               {"layers": [-1], "pooling": "max"},
                                               {"layers": "all", "pooling": "mean"}]), "select")
    metrics = run(params, select_folder, [paths.fitted_map("linear_k1_noisy")], 0.2, declared=declared)
    agreement = {label: metrics[f"lookahead/{label}"]["prompts"]["agreement"] for label in ("-1:max", "all:mean")}
    assert agreement["all:mean"] > agreement["-1:max"]  # the second listed, and the worse perplexity: the rule decides
    chosen = SpeculativeParams.model_validate(json.loads(paths.LOOKAHEAD.read_text()))
    assert metrics["selected_lookahead"] == chosen.label == "all:mean"
    assert (chosen.last, chosen.sinks) == (2, 1)  # the declared spans kept
    assert promoted()[1]["speculative"] == chosen.model_dump()  # the source-ranked repair scored under the choice
