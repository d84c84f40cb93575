"""The FLOP model against PROTOCOL.md's figures for the Qwen3-0.6B -> Qwen3-1.7B pair, a repair's budget and
speedup bound, and a first step's multiply-adds part by part."""
import pytest

from pipeline.kv.flops import (
    attention_macs,
    first_step_macs,
    handoff_macs,
    linear_macs_per_token,
    mapper_macs_per_token,
    repair_budget,
    source_alone_bound,
    source_scores_macs,
    speculative_bound,
    speedup_bound,
    target_prefill_macs,
    truncated_bound,
)
from pipeline.kv.mapper import random_mapper
from pipeline.kv.repair import Repair
from pipeline.kv.speculative import SpeculativeParams
from pipeline.store.params import parse
from pipeline.store.shapes import pair_configs

SOURCE, TARGET = pair_configs("qwen3-v0")


def test_linear_layers_cost_440m_and_1410m_multiply_adds_per_token():
    assert linear_macs_per_token(SOURCE) / 1e6 == pytest.approx(440, rel=0.005)
    assert linear_macs_per_token(TARGET) / 1e6 == pytest.approx(1410, rel=0.005)


def test_attention_costs_57k_per_token_per_prefix_token_in_both_models():
    for config in (SOURCE, TARGET):
        per_token_per_prefix = attention_macs(config, 0, 2048) / 2048 / 2048  # average token reads n/2 keys
        assert per_token_per_prefix / 1e3 == pytest.approx(57.3, rel=0.01)


@pytest.mark.parametrize("k, family, millions", [(1, "linear", 59), (1, "head_matched", 7), (4, "linear", 235)])
def test_mapper_multiply_adds_per_token_match_protocol(k, family, millions):
    assert mapper_macs_per_token(SOURCE, TARGET, k, family) / 1e6 == pytest.approx(millions, rel=0.05)


def test_mapper_count_from_configs_equals_a_built_mappers_weights():
    mapper = random_mapper(SOURCE, TARGET, k=2)
    assert mapper_macs_per_token(SOURCE, TARGET, 2, "linear") == sum(w.numel() for w, _ in mapper.keys + mapper.values)


@pytest.mark.parametrize("length, bound", [(128, 2.8), (2048, 2.5), (8192, 1.9)])
def test_k1_bound_matches_protocol(length, bound):
    assert speedup_bound(SOURCE, TARGET, mapper_macs_per_token(SOURCE, TARGET, 1, "linear"), length) == pytest.approx(
        bound, abs=0.06)


def test_handoff_step_reads_the_whole_prefix_once_and_source_computes_no_logits():
    parts = handoff_macs(SOURCE, TARGET, 0, 100)
    assert parts["step"] == linear_macs_per_token(TARGET) + attention_macs(TARGET, 99, 100) + 2048 * 151936
    assert parts["source"] == 99 * linear_macs_per_token(SOURCE) + attention_macs(SOURCE, 0, 99)
    # target prefill = target over the prefix + the same last step: the decomposition is exact
    assert target_prefill_macs(TARGET, 100) == 99 * linear_macs_per_token(TARGET) + attention_macs(
        TARGET, 0, 99) + parts["step"]


def test_the_source_alone_costs_its_own_prefill_and_the_truncated_prompt_its_kept_tokens():
    # the source's prefill at the V0 pair's shapes: about 440M / 1410M of the target's linear work per token, plus
    # attention (equal per token) and logits (the source has its own)
    assert 2.5 < source_alone_bound(SOURCE, TARGET, 1024) < 3.2
    assert source_alone_bound(SOURCE, TARGET, 8192) < source_alone_bound(SOURCE, TARGET, 128)  # attention dominates
    assert truncated_bound(TARGET, 1.0, 1024) == 1.0
    tenth = truncated_bound(TARGET, 0.1, 1024)
    assert tenth == target_prefill_macs(TARGET, 1024) / target_prefill_macs(TARGET, 102) and tenth > 10  # quadratic
    assert truncated_bound(TARGET, 1e-6, 1024) == target_prefill_macs(TARGET, 1024) / target_prefill_macs(TARGET, 1)


def _qwen3_v0():
    return pair_configs("qwen3-v0")


def test_the_budget_is_zero_for_no_repair_and_about_one_for_a_full_one():
    _, target = _qwen3_v0()
    assert repair_budget(target, Repair(), 1024) == 0
    assert 0.95 < repair_budget(target, Repair(sink=1023), 1024) < 1  # the whole prefix, no last token, no logits
    assert 0.95 < repair_budget(target, Repair(exact_layers=target.num_hidden_layers), 1024) < 1
    assert 1 <= repair_budget(target, Repair(tokens=1.0), 1024) < 1.5  # dense reads over the whole prefix


def test_the_budget_grows_with_the_fraction_and_a_selection_costs_its_own_work():
    _, target = _qwen3_v0()
    budgets = [repair_budget(target, Repair(tokens=rho), 1024) for rho in (0.05, 0.1, 0.2)]
    assert budgets == sorted(budgets) and 0.04 < budgets[0] < 0.07
    recency = repair_budget(target, Repair(tokens=0.1, select_by="recency"), 1024)
    assert repair_budget(target, Repair(tokens=0.1, select_by="deviation"), 1024) > recency
    assert repair_budget(target, Repair(tokens=0.1, select_by="attention"), 1024) > recency


def test_the_speedup_bound_with_a_repair_is_lower_and_none_leaves_it_as_it_was():
    source, target = _qwen3_v0()
    per_token = mapper_macs_per_token(source, target, 1, "linear")
    plain = speedup_bound(source, target, per_token, 1024)
    assert speedup_bound(source, target, per_token, 1024, Repair()) == plain
    assert speedup_bound(source, target, per_token, 1024, Repair(sink=4, tokens=0.1, select_by="attention")) < plain


LOOKAHEAD = {"last": 8, "sinks": 4, "layers": "all", "pooling": "max"}


@pytest.mark.parametrize("pair", ["qwen3-v0", "llama-3.2-1b-3b", "qwen25-coder"])
@pytest.mark.parametrize("length", [128, 2048])
def test_a_first_steps_parts_add_up_to_the_multiply_adds_its_bound_counts(pair, length):
    source, target = pair_configs(pair)
    settings = parse(SpeculativeParams, LOOKAHEAD, "speculative")
    per_token = mapper_macs_per_token(source, target, 1, "linear")
    prefill = target_prefill_macs(target, length)
    plain = first_step_macs(source, target, length, per_token)
    assert set(plain) == {"prefill", "map", "step"} and prefill / sum(plain.values()) == pytest.approx(
        speedup_bound(source, target, per_token, length))
    repair = Repair.parse("tokens:0.08:source_attention")
    hybrid = first_step_macs(source, target, length, per_token, repair, settings)
    scores = source_scores_macs(source, repair, settings, length)
    assert hybrid["scores"] == scores > 0 and hybrid["repair"] > 0  # the selection by the scores is the scores
    assert prefill / sum(hybrid.values()) == pytest.approx(speedup_bound(source, target, per_token, length, repair,
                                                                         scores))
    sparse = first_step_macs(source, target, length, settings=settings, share=0.1)
    assert set(sparse) == {"prefill", "scores", "sparse", "step"} and sparse["prefill"] == plain["prefill"]
    assert prefill / sum(sparse.values()) == pytest.approx(speculative_bound(source, target, settings, 0.1, length))
