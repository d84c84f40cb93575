"""Stage `repair` on a tiny pair built here: the unrepaired setting is the mapped handoff, a full repair the oracle,
and the truncated prompt keeps the last share of each context and scores as the oracle on it; speculative prefill
runs beside it at each budget level."""
import pandas as pd
import pytest
from helpers import committed, hellaswag_rows, piqa_rows

from pipeline.kv.flops import speculative_bound
from pipeline.kv.mapper import random_mapper, save_mapper
from pipeline.kv.pair import Pair
from pipeline.kv.repair import Repair
from pipeline.kv.scoring import score_continuations
from pipeline.kv.speculative import SpeculativeParams
from pipeline.measure.compare import oracle_outputs, variant_rows
from pipeline.repair import matched_baselines, policy, scored
from pipeline.schema.repair import RepairParams
from pipeline.store.fingerprints import pair_fingerprints
from pipeline.store.params import parse
from pipeline.store.shapes import pair_configs

ITEMS = 6  # per task
PROMPTS = 4


@pytest.fixture(scope="module")
def setup(wide_pair, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("repair")
    pair = Pair(str(wide_pair["target"]), str(wide_pair["source"]), "float32", "cpu")
    mapper = random_mapper(pair.source.config, pair.target.config, k=1, seed=0)
    mapper.models = pair_fingerprints(str(wide_pair["source"]), str(wide_pair["target"]))  # bound to its pair
    save_mapper(mapper, root / "k1.safetensors")
    pd.DataFrame(hellaswag_rows(ITEMS)).to_parquet(root / "hellaswag.parquet", index=False)
    pd.DataFrame(piqa_rows(ITEMS)).to_parquet(root / "piqa.parquet", index=False)
    tasks = {"hellaswag": root / "hellaswag.parquet", "piqa": root / "piqa.parquet"}
    prompts = [(list(range(3 + i, 15 + 2 * i)), [5, 6, 7, 8]) for i in range(PROMPTS)]
    oracle = oracle_outputs(pair.handoff("oracle"), prompts, 8, 4, 2, progress=False)
    return {"pair": pair, "map": root / "k1.safetensors", "tasks": tasks, "prompts": prompts, "oracle": oracle}


def _figures(setup: dict, **request) -> tuple[dict, pd.DataFrame]:
    """The figures and item rows of the handoff `request` asks for, as the stage evaluates each."""
    router = setup["pair"].router(**request, batch_size=2)
    evaluation = scored(setup["pair"], router, setup["tasks"], setup["prompts"], setup["oracle"], 0.2, None)
    return evaluation.figures(), evaluation.item_rows


@pytest.mark.slow  # five lm-eval runs of 12 items on a tiny pair
def test_none_is_the_unrepaired_map_and_a_full_repair_is_the_oracle(setup):
    path = setup["map"]
    grid = {}
    for setting in ("none", "tokens:1:recency"):
        grid[setting] = _figures(setup, mode="mapped", mapper=path, repair=Repair.parse(setting))
    mapped, mapped_items = _figures(setup, mode="mapped", mapper=path)
    oracle, oracle_items = _figures(setup, mode="oracle")
    assert grid["none"][0] == mapped
    pd.testing.assert_frame_equal(grid["none"][1], mapped_items)
    repaired_figures, repaired_items = grid["tokens:1:recency"]
    for task in ("hellaswag", "piqa"):
        for metric in ("acc", "acc_norm"):
            assert repaired_figures["tasks"][task][metric] == oracle["tasks"][task][metric]
    assert (repaired_items.acc.to_numpy() == oracle_items.acc.to_numpy()).all()
    repaired_prompts, oracle_prompts = repaired_figures["prompts"], oracle["prompts"]
    assert repaired_prompts["next_token_top1"] == 1.0 and repaired_prompts["rollout_agreement"] == 1.0
    assert repaired_prompts["mean_kl"] < 1e-4
    assert repaired_prompts["confident_top1"] in (1.0, None) and repaired_prompts["confident_agreement"] in (1.0, None)
    assert repaired_prompts["oracle_weighted_agreement"] == pytest.approx(oracle_prompts["oracle_weighted_agreement"],
                                                                          abs=1e-5)


def test_the_truncated_prompt_keeps_the_last_share_of_each_context_and_at_least_one_token(setup):
    pair = setup["pair"]
    assert pair.handoff("oracle", keep=0.3).context(range(10)) == [7, 8, 9]
    assert pair.handoff("oracle", keep=0.01).context(range(10)) == [9]
    assert pair.handoff("oracle", keep=1.0).context(range(10)) == list(range(10))


def test_the_truncated_prompt_handoff_scores_tasks_and_prompts_as_the_oracle_on_the_trimmed_contexts(setup):
    pair, prompts, keep = setup["pair"], setup["prompts"], 0.4
    truncated, oracle = pair.handoff("oracle", keep=keep), pair.handoff("oracle")
    trimmed = [(truncated.context(context), continuation) for context, continuation in prompts]
    assert all(len(short) < len(context) for (short, _), (context, _) in zip(trimmed, prompts))
    assert score_continuations(truncated, prompts, progress=False) == score_continuations(oracle, trimmed,
                                                                                          progress=False)
    pd.testing.assert_frame_equal(variant_rows(truncated, prompts, setup["oracle"], 2, progress=False),
                                  variant_rows(oracle, trimmed, setup["oracle"], 2, progress=False))


def test_a_settings_policy_is_its_token_choice_or_its_parts_without_sizes():
    settings = ("none", "layers:1", "tokens:0.1:attention", "sink:4+tokens:0.1:deviation")
    assert [policy(Repair.parse(s)) for s in settings] == ["none", "layers", "attention", "sink+deviation"]


def test_each_budget_level_has_the_truncated_prompt_and_speculative_prefill_at_that_share(setup):
    params = parse(RepairParams, committed("repair", batch_size=2, length=256), "repair")
    lookahead = parse(SpeculativeParams, committed("speculative", last=2, sinks=1), "speculative")
    configs = pair_configs("qwen3-v0")
    found = list(matched_baselines(setup["pair"], params, [0.5], setup["tasks"], setup["prompts"], setup["oracle"],
                                   0.2, None, lookahead, configs))
    assert [(name, level) for name, level, _, _ in found] == [("truncated", 0.5), ("speculative", 0.5)]
    (_, _, truncated, truncated_figures), (_, _, speculative, figures) = found
    assert figures["bound"] == round(speculative_bound(*configs, lookahead, 0.5, 256), 4) and \
        "bound" not in truncated_figures
    assert figures["tasks"]["piqa"]["n"] == ITEMS and len(speculative.prompt_rows) == PROMPTS
    oracle, _ = _figures(setup, mode="oracle")
    assert figures["prompts"]["next_token_top1"] <= oracle["prompts"]["next_token_top1"]
