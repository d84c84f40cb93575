"""The repair's selectors (`kv/selectors/`): one registry every list of policies comes from, and a cost no policy
can leave out (the FLOP model asks each selector for its own)."""
import pytest

from pipeline.kv import flops
from pipeline.kv.repair import REPAIR_FORM, Repair
from pipeline.kv.selectors import registry
from pipeline.kv.selectors.base import Selector
from pipeline.kv.selectors.registry import POLICIES, SELECTORS, register
from pipeline.store.shapes import pair_configs


class Scoreless(Selector):
    name = "scoreless"

    def score(self, evidence, argument):
        return None


class Priced(Scoreless):
    name = "priced"

    def cost(self, work, argument):
        return 12345


def test_a_selector_without_a_cost_cannot_be_instantiated_or_registered():
    with pytest.raises(TypeError, match="cost"):
        Scoreless()
    with pytest.raises(TypeError, match="not a named"):
        register(Scoreless)
    assert register(Priced())["priced"].cost(None, None) == 12345


def test_the_registry_refuses_a_name_twice():
    with pytest.raises(ValueError, match="named twice"):
        register(Priced(), Priced())


def test_policies_and_the_settings_form_come_from_the_registry():
    assert POLICIES == tuple(SELECTORS) and set(POLICIES) >= {"deviation", "attention", "recency", "key_norm"}
    assert all(name in REPAIR_FORM for name in POLICIES)


def test_a_new_policy_is_parsed_and_its_own_cost_is_in_the_budget(monkeypatch):
    monkeypatch.setitem(SELECTORS, "priced", Priced())
    monkeypatch.setattr(registry, "POLICIES", (*POLICIES, "priced"))
    monkeypatch.setattr("pipeline.kv.repair.POLICIES", (*POLICIES, "priced"))
    _, target = pair_configs("qwen3-v0")
    setting = Repair.parse("tokens:0.1:priced")
    assert flops.repair_macs(target, setting, 1024)["selection"] == 12345


@pytest.mark.parametrize("policy", POLICIES)
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
