"""The repair's selectors (`kv/selectors/`): one registry of declarations every list of policies comes from, a cost
no policy can leave out (the FLOP model asks each selector for its own), and one registry of their maths
(`kv/selectors/maths/`) keyed by the same names, which refuses a declared policy without maths."""
import pytest
import torch
from helpers import build_model, llama_config

from pipeline.kv import flops, recompute
from pipeline.kv.handoff import Handoff
from pipeline.kv.mapper import identity_mapper
from pipeline.kv.repair import REPAIR_FORM, Repair
from pipeline.kv.selectors import registry
from pipeline.kv.selectors.base import Selector
from pipeline.kv.selectors.maths import registry as maths_registry
from pipeline.kv.selectors.maths.base import SelectorMaths
from pipeline.kv.selectors.maths.recency import MATHS as RECENCY
from pipeline.kv.selectors.maths.registry import SELECTOR_MATHS
from pipeline.kv.selectors.registry import POLICIES, SELECTORS, register
from pipeline.store.shapes import pair_configs


class Costless(Selector):
    name = "costless"


class Priced(Costless):
    name = "priced"

    def cost(self, work, argument):
        return 12345


PRICED = Priced()


class PricedMaths(SelectorMaths):
    """`priced` scores as `recency` does, by its own entry."""

    declaration = PRICED

    def score(self, evidence, argument):
        return RECENCY.score(evidence, argument)


class Scoreless(SelectorMaths):
    declaration = SELECTORS["recency"]


def test_a_selector_without_a_cost_cannot_be_instantiated_or_registered():
    with pytest.raises(TypeError, match="cost"):
        Costless()
    with pytest.raises(TypeError, match="not a named"):
        register(Costless)
    assert register(Priced())["priced"].cost(None, None) == 12345


def test_the_registry_refuses_a_name_twice():
    with pytest.raises(ValueError, match="named twice"):
        register(Priced(), Priced())


def test_policies_and_the_settings_form_come_from_the_registry():
    assert POLICIES == tuple(SELECTORS) and set(POLICIES) >= {"deviation", "attention", "recency", "key_norm"}
    assert all(name in REPAIR_FORM for name in POLICIES)


def test_the_maths_registry_names_the_declared_selectors_each_with_its_own_declaration():
    assert tuple(SELECTOR_MATHS) == POLICIES
    assert all(SELECTOR_MATHS[name].declaration is SELECTORS[name] for name in POLICIES)


def test_a_declared_policy_without_maths_is_refused_when_the_maths_are_registered():
    with pytest.raises(ValueError, match=r"^'priced' is declared \(kv.selectors.registry\) but has no maths: add them "
                                         r"in kv/selectors/maths/ and their line in kv.selectors.maths.registry$"):
        maths_registry.register(*SELECTOR_MATHS.values(), declared={**SELECTORS, "priced": PRICED})
    with pytest.raises(ValueError, match="'recency' is declared"):
        maths_registry.register(*(maths for name, maths in SELECTOR_MATHS.items() if name != "recency"))


def test_maths_of_no_declared_policy_or_without_a_score_are_refused():
    with pytest.raises(ValueError, match="^the maths 'priced' compute no declared entry"):
        maths_registry.register(*SELECTOR_MATHS.values(), PricedMaths())
    with pytest.raises(TypeError, match="score"):
        Scoreless()
    with pytest.raises(TypeError, match="is not a named kv.selectors.maths.base.SelectorMaths instance"):
        maths_registry.register(Scoreless)
    with pytest.raises(ValueError, match="named twice"):
        maths_registry.register(*SELECTOR_MATHS.values(), SELECTOR_MATHS["recency"])


def test_a_new_policy_is_parsed_and_its_own_cost_is_in_the_budget(monkeypatch):
    monkeypatch.setitem(SELECTORS, "priced", PRICED)
    monkeypatch.setattr(registry, "POLICIES", (*POLICIES, "priced"))
    monkeypatch.setattr("pipeline.kv.repair.POLICIES", (*POLICIES, "priced"))
    _, target = pair_configs("qwen3-v0")
    setting = Repair.parse("tokens:0.1:priced")
    assert flops.repair_macs(target, setting, 1024)["selection"] == 12345


def test_a_new_policy_with_its_maths_registered_repairs_through_its_own_entry(monkeypatch):
    monkeypatch.setitem(SELECTORS, "priced", PRICED)
    monkeypatch.setattr("pipeline.kv.repair.POLICIES", (*POLICIES, "priced"))
    monkeypatch.setattr(recompute, "SELECTOR_MATHS", maths_registry.register(*SELECTOR_MATHS.values(), PricedMaths(),
                                                                             declared=SELECTORS))
    target, source = (build_model(llama_config(31, hidden, layers=2), seed=seed) for hidden, seed in ((32, 1), (16, 2)))
    mapper = identity_mapper("source", "target", source.config, target.config)
    ids = torch.randint(0, 31, (2, 9), generator=torch.Generator().manual_seed(0))  # (B, P)
    repaired = {policy: Handoff(target, source, "mapped", mapper, repair=Repair.parse(f"tokens:0.5:{policy}"))
                .prefix_layers(ids, torch.tensor([9, 6])) for policy in ("priced", "recency")}
    assert all(torch.equal(a, b) for layer, other in zip(repaired["priced"], repaired["recency"])
               for a, b in zip(layer, other))


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
