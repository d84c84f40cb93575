"""The repair's selectors (`kv.selectors`): one registry every list of policies comes from, each entry a class with
a cost and a score that no policy can leave out (the FLOP model asks each selector for its own); `key_norm`, priced
by the keys it reads; `source_attention`: the repair recomputes the mapped cache's tokens the source's look-ahead
attends to most, from the scores of the forward that prefilled the source's cache. A source built to attend to one
token (a constant query, a key read from one embedding feature that only that token carries, no attention output or
MLP to stir the residual stream) has that token recomputed, wherever it stands, and speculative prefill keeps it;
the first step names the positions it chose, which the selection recall reads."""
import pandas as pd
import pytest
import torch
from helpers import build_model, committed, llama_config, measure_params
from helpers.architectures import SUPPORTED, random_of

import pipeline.repair as repair_stage
from pipeline.kv import entries, flops, selectors
from pipeline.kv.flops import repair_budget
from pipeline.kv.handoff import Handoff
from pipeline.kv.kvcache import padded_prefixes
from pipeline.kv.mapper import identity_mapper
from pipeline.kv.modes import Prompt, source_prefill
from pipeline.kv.recompute import RepairCount
from pipeline.kv.repair import REPAIR_FORM, Repair, RepairError
from pipeline.kv.selectors import POLICIES, SELECTORS, Evidence, Selector
from pipeline.kv.speculative import SpeculativeParams
from pipeline.measure.retrieval import needle_selected
from pipeline.store.params import parse
from pipeline.store.shapes import pair_configs
from pipeline.studies import render
from pipeline.studies import repair as repair_study
from pipeline.studies.settings import ReportParams

LAYERS, WIDTH = 3, 12
LOOKAHEAD = parse(SpeculativeParams, committed("speculative", last=2, sinks=0), "speculative")
MARKED, FEATURE, MARKED_WIDTH = 5, 0, 14  # the token the source attends to, the embedding feature only it carries


class Costless(Selector):
    name = "costless"

    def score(self, evidence, argument):
        return SELECTORS["recency"].score(evidence, argument)


class Priced(Costless):
    """`priced` scores as `recency` does, by its own entry."""

    name = "priced"

    def cost(self, work, argument):
        return 12345


class Scoreless(Selector):
    name = "scoreless"

    def cost(self, work, argument):
        return 0


PRICED = Priced()


def test_a_selector_without_a_cost_or_a_score_cannot_be_instantiated_or_registered():
    with pytest.raises(TypeError, match="cost"):
        Costless()
    with pytest.raises(TypeError, match="score"):
        Scoreless()
    with pytest.raises(TypeError, match="is not a named kv.selectors.Selector instance"):
        entries.register(Selector, "policies", (Costless,))
    assert entries.register(Selector, "policies", (Priced(),))["priced"].cost(None, None) == 12345


def test_the_registry_refuses_a_name_twice():
    with pytest.raises(ValueError, match="named twice"):
        entries.register(Selector, "policies", (Priced(), Priced()))


def test_policies_and_the_settings_form_come_from_the_registry():
    assert POLICIES == tuple(SELECTORS) and set(POLICIES) >= {"deviation", "attention", "recency", "key_norm"}
    assert all(name in REPAIR_FORM for name in POLICIES)


def test_a_new_policy_is_parsed_and_its_own_cost_is_in_the_budget(monkeypatch):
    monkeypatch.setitem(SELECTORS, "priced", PRICED)
    monkeypatch.setattr(selectors, "POLICIES", (*POLICIES, "priced"))
    monkeypatch.setattr("pipeline.kv.repair.POLICIES", (*POLICIES, "priced"))
    _, target = pair_configs("qwen3-v0")
    setting = Repair.parse("tokens:0.1:priced")
    assert flops.repair_macs(target, setting, 1024)["selection"] == 12345


def test_a_new_policy_in_the_registry_repairs_through_its_own_entry(monkeypatch):
    monkeypatch.setitem(SELECTORS, "priced", PRICED)
    monkeypatch.setattr("pipeline.kv.repair.POLICIES", (*POLICIES, "priced"))
    target, source = (build_model(llama_config(31, hidden, layers=2), seed=seed) for hidden, seed in ((32, 1), (16, 2)))
    mapper = identity_mapper("source", "target", source.config, target.config)
    ids = torch.randint(0, 31, (2, 9), generator=torch.Generator().manual_seed(0))  # (B, P)
    repaired = {policy: Handoff(target, source, "mapped", mapper, repair=Repair.parse(f"tokens:0.5:{policy}"))
                .prefix_layers(ids, torch.tensor([9, 6])) for policy in ("priced", "recency")}
    assert all(torch.equal(a, b) for layer, other in zip(repaired["priced"], repaired["recency"])
               for a, b in zip(layer, other))


def test_a_new_policy_reaches_the_repair_studys_table_and_figure_by_its_own_name(monkeypatch, tmp_path):
    monkeypatch.setitem(SELECTORS, "priced", PRICED)
    monkeypatch.setattr("pipeline.kv.repair.POLICIES", (*POLICIES, "priced"))
    setting, (_, target) = Repair.parse("tokens:0.1:priced"), pair_configs("qwen3-v0")
    figures = {"prompts": {"next_token_top1": 0.5, "rollout_agreement": 0.4, "mean_kl": 0.3}}
    settings = {str(setting): {**figures, "policy": repair_stage.policy(setting), "bound": 2.5,
                               "budget": repair_budget(target, setting, 256)},  # as stage repair writes them
                "none": {**figures, "policy": "none", "budget": 0.0, "bound": 3.0}}
    metrics = {"length": 256, "bound_pair": "qwen3-v0", "maps": {"m": settings}, "truncated": {}, "speculative": {}}
    def items(correct: list[int]) -> pd.DataFrame:
        return pd.DataFrame([{"task": task, "item": i, "acc": c, "acc_norm": c} for task in ("hellaswag", "piqa")
                             for i, c in enumerate(correct)])

    rows = {("m", name): items([1, 1, 1, 1, 1, 1, 0, 1]) for name in settings}
    study = repair_study.compute(parse(ReportParams, committed("report"), "report"), measure_params(bootstrap_iters=20),
                                 repair_study.Inputs({"oracle": items([1] * 8), "source": items([1, 0] * 4)}, metrics,
                                                     rows, figures))
    budget = f"{repair_budget(target, setting, 256):.1%}"
    assert f"| m | tokens:0.1:priced | {budget} | priced |" in render.section("repair", study)
    assert "priced" in set(repair_study.figure(study, tmp_path)["repair"]["policy"])


@pytest.mark.parametrize("policy", [policy for policy in POLICIES if not SELECTORS[policy].reads_source])
def test_every_policy_counts_its_selection_as_the_flop_model_did_before_the_registry(policy):
    # the if-chain the registry replaced, kept here as the reference: budgets and artifacts must not move
    _, target = pair_configs("qwen3-v0")
    for text in (f"tokens:0.1:{policy}", f"layers:1+tokens:0.1:{policy}"):
        setting = Repair.parse(text)
        prefix, layers = 1023, target.num_hidden_layers
        read = 2 * target.num_attention_heads * target.head_dim
        reference = {"deviation": 0 if setting.exact_layers else prefix * flops.kv_projection_macs_per_token(target),
                     "attention": flops.linear_macs_per_token(target) + read * layers * (prefix + 1) * 3 // 2,
                     "recency": 0,
                     "key_norm": prefix * layers * target.num_key_value_heads * target.head_dim}[policy]
        assert flops.repair_macs(target, setting, 1024)["selection"] == reference


def _layers(scale: dict[tuple[int, int], float]) -> list:
    """Per layer unit-norm keys of 1 row (1, 2, WIDTH, 16), the (layer, slot) pairs of `scale` scaled by it."""
    generator = torch.Generator().manual_seed(0)
    layers = []
    for index in range(LAYERS):
        keys = torch.randn(1, 2, WIDTH, 16, generator=generator)
        keys = keys / keys.pow(2).sum(dim=(1, 3), keepdim=True).sqrt()
        for (layer, slot), factor in scale.items():
            if layer == index:
                keys[:, :, slot] *= factor
        layers.append((keys, torch.zeros_like(keys)))
    return layers


def _key_norm_scores(layers, argument=None, length=WIDTH):
    evidence = Evidence(None, layers, layers, None, 0, torch.zeros(1, WIDTH, dtype=torch.long),
                        torch.tensor([length]), RepairCount(), None, None)
    return SELECTORS["key_norm"].score(evidence, argument)


def test_key_norm_scores_the_largest_mapped_keys_highest():
    scores = _key_norm_scores(_layers({(0, 3): 4.0, (2, 7): 3.0}))
    assert scores[0].topk(2).indices.sort().values.tolist() == [3, 7]


def test_key_norm_with_a_parameter_reads_only_the_first_layers():
    scores = _key_norm_scores(_layers({(0, 3): 4.0, (2, 7): 30.0}), argument=2)
    assert scores[0].argmax().item() == 3


def test_key_norm_does_not_let_padding_set_a_rows_scale():
    # a huge key past the row's length would shrink every real token's relative score if it were averaged in
    real = _key_norm_scores(_layers({}), length=8)[0, :8]
    padded = _key_norm_scores(_layers({(0, 10): 100.0, (1, 10): 100.0, (2, 10): 100.0}), length=8)[0, :8]
    assert torch.allclose(real, padded)


def test_key_norms_parameter_prints_back_and_is_checked_against_the_target():
    assert str(Repair.parse("tokens:0.1:key_norm@2")) == "tokens:0.1:key_norm@2"
    assert Repair.parse("tokens:0.1:key_norm@2") == Repair(tokens=0.1, select_by="key_norm", argument=2)
    with pytest.raises(RepairError, match="count >= 1"):
        Repair.parse("tokens:0.1:key_norm@0")
    assert Repair.parse("tokens:0.5:key_norm@3").policy_refusal(2) == "policy key_norm@3: the target has only 2 layers"
    assert Repair.parse("tokens:0.5:key_norm@2").policy_refusal(2) is None


def test_key_norm_reading_fewer_layers_costs_less_and_any_reading_costs_more_than_recency():
    _, target = pair_configs("qwen3-v0")
    recency, two, every = (repair_budget(target, Repair.parse(f"tokens:0.1:{p}"), 1024)
                           for p in ("recency", "key_norm@2", "key_norm"))
    assert recency < two < every


def attending_source():
    """A Qwen2 (q/k biases) whose every layer's every query attends to token MARKED: query = its bias, along the
    last head dim (RoPE's slowest pair: nearly unrotated over a few positions), key = the normed FEATURE."""
    model = random_of(SUPPORTED["qwen2"]())
    dim = model.config.head_dim if getattr(model.config, "head_dim", None) else 16
    with torch.no_grad():
        embedding = model.model.embed_tokens.weight  # (V, hidden)
        embedding[:, FEATURE] = 0.0
        embedding[MARKED, FEATURE] = 1.0
        for layer in model.model.layers:
            attention = layer.self_attn
            for projection in (attention.q_proj, attention.k_proj):
                projection.weight.zero_()
                projection.bias.zero_()
            attention.q_proj.bias.view(-1, dim)[:, -1] = 30.0  # (Hq, D): every head
            attention.k_proj.weight.view(-1, dim, model.config.hidden_size)[:, -1, FEATURE] = 30.0
            attention.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


@pytest.fixture(scope="module")
def models():
    target = random_of(SUPPORTED["qwen2"]())
    return target, attending_source()


def _prefix(at: int) -> torch.Tensor:
    ids = torch.arange(20, 20 + MARKED_WIDTH)[None]  # (1, P): no token is MARKED
    ids[0, at] = MARKED
    return ids


@pytest.mark.parametrize("at", [3, 8])
def test_the_token_the_source_attends_to_scores_highest_and_is_the_one_recomputed(models, at):
    target, source = models
    prefix = _prefix(at)
    handoff = Handoff(target, source, "direct", repair=Repair.parse("tokens:0.07:source_attention"),
                      speculative=LOOKAHEAD)
    _, scores = source_prefill(handoff.inputs, Prompt(prefix), scored=True)  # (1, P)
    assert int(scores[0, : MARKED_WIDTH - LOOKAHEAD.last].argmax()) == at
    unrepaired = Handoff(target, source, "direct").prefix_layers(prefix)
    repaired = handoff.prefix_layers(prefix)
    oracle = Handoff(target).prefix_layers(prefix)
    keys, before = repaired[0][0][0], unrepaired[0][0][0]  # (H, P, D): layer 0
    changed = [slot for slot in range(MARKED_WIDTH) if not torch.equal(keys[:, slot], before[:, slot])]
    assert changed == [at] and handoff.repaired.recomputed == 1  # round(0.07 x 14) = 1 token
    assert torch.allclose(repaired[0][0][0, :, at], oracle[0][0][0, :, at], atol=1e-5)  # layer 0: the token's own


def test_a_source_without_the_marked_token_chooses_elsewhere(models):
    target, source = models
    handoff = Handoff(target, source, "direct", speculative=LOOKAHEAD)
    _, scores = source_prefill(handoff.inputs, Prompt(torch.arange(20, 20 + MARKED_WIDTH)[None]), scored=True)
    assert float(scores.max()) < 0.5  # no one token draws the look-ahead: the selection follows the source


def test_source_attentions_selection_costs_the_sources_look_ahead_key_norm_scores():
    source, target = pair_configs("qwen3-v0")
    setting, scores = Repair.parse("tokens:0.1:source_attention"), flops.lookahead_macs(source, LOOKAHEAD, 1024)
    assert flops.repair_macs(target, setting, 1024, scores)["selection"] == scores > 0
    assert flops.repair_budget(target, setting, 1024, scores) > flops.repair_budget(
        target, Repair.parse("tokens:0.1:recency"), 1024)
    with pytest.raises(ValueError, match="its selection costs the source's look-ahead scores"):
        flops.repair_macs(target, setting, 1024)


@pytest.mark.parametrize("at", [3, 8])
def test_the_first_step_names_the_positions_it_chose_so_the_marked_token_is_selected_wherever_it_stands(models, at):
    target, source = models
    context = _prefix(at)[0].tolist() + [7]  # the prefix, then the last token the target steps on
    handoffs = {"source_attention": Handoff(target, source, "direct", speculative=LOOKAHEAD,
                                            repair=Repair.parse("tokens:0.07:source_attention")),
                "speculative": Handoff(target, source, "speculative", share=0.1, speculative=LOOKAHEAD),
                "recency": Handoff(target, source, "direct", repair=Repair.parse("sink:1+tokens:0.07:recency"))}
    chosen = {name: handoff.first_step(padded_prefixes([context])).selected[0].tolist()
              for name, handoff in handoffs.items()}
    last = [MARKED_WIDTH - 2, MARKED_WIDTH - 1]
    assert chosen == {"source_attention": [at], "speculative": [at, *last],  # p: 1 of 12, the last 2
                      "recency": [0, MARKED_WIDTH - 1]}  # the sink, then the prefix's end
    assert needle_selected(chosen["source_attention"], context, [MARKED])
    assert needle_selected(chosen["speculative"], context, [MARKED])
    assert not needle_selected(chosen["recency"], context, [MARKED])
    assert Handoff(target, source, "direct").first_step(padded_prefixes([context])).selected is None  # none chosen
    assert Handoff(target).first_step(padded_prefixes([context])).selected is None
