"""Repair after the map (`kv.repair`): the setting's one parser, its known answers against the oracle's cache, and
what it makes the target compute; on a Qwen3-shaped pair (q_norm/k_norm per head) and a Llama one (no q/k norm,
grouped queries, llama3 RoPE), every policy of the registry."""
import pytest
import torch
import yaml
from helpers import ARCHITECTURES, ROOT, build_model, committed

from pipeline.kv.handoff import Handoff
from pipeline.kv.mapper import identity_mapper
from pipeline.kv.repair import Repair, RepairError
from pipeline.kv.selectors import POLICIES
from pipeline.kv.speculative import SpeculativeParams
from pipeline.store.params import parse

VOCAB, LAYERS = 97, 3


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def architecture(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def target(architecture):
    return build_model(ARCHITECTURES[architecture](VOCAB, 64, layers=LAYERS), seed=1)


@pytest.fixture(scope="module")
def source(architecture):
    return build_model(ARCHITECTURES[architecture](VOCAB, 32, layers=LAYERS), seed=2)


def _mapped(target, source, repair: str = "none") -> Handoff:
    mapper = identity_mapper("source", "target", source.config, target.config)
    lookahead = parse(SpeculativeParams, committed("speculative"), "speculative")  # what source_attention reads
    return Handoff(target, source, "mapped", mapper, repair=Repair.parse(repair), speculative=lookahead)


def _prefixes(batch=3, width=19, seed=0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, width), generator=generator)  # (B, P)
    lengths = torch.tensor([width, width - 6, width - 11][:batch])
    return ids, lengths


def _max_error(layers, reference, lengths):
    """Largest |difference| over the real slots of every row and layer."""
    worst = 0.0
    for (k, v), (rk, rv) in zip(layers, reference):
        for row, n in enumerate(lengths.tolist()):
            worst = max(worst, (k[row, :, :n] - rk[row, :, :n]).abs().max().item(),
                        (v[row, :, :n] - rv[row, :, :n]).abs().max().item())
    return worst


def test_the_string_form_parses_in_any_order_and_prints_in_the_applied_order():
    setting = Repair.parse("tokens:0.1:attention+sink:4")
    assert setting == Repair(sink=4, tokens=0.1, select_by="attention")
    assert str(setting) == "sink:4+tokens:0.1:attention"
    assert Repair.parse("none").empty and Repair.parse(str(Repair(exact_layers=2))) == Repair(exact_layers=2)


@pytest.mark.parametrize("text, part", [("sink:four", "sink:four"), ("tokens:0.1", "tokens:0.1"),
                                        ("tokens:0.1:luck", "tokens:0.1:luck"), ("layers:1+layers:2", "layers:2"),
                                        ("heads:3", "heads:3")])
def test_a_malformed_setting_is_one_line_naming_the_bad_part(text, part):
    with pytest.raises(RepairError) as error:
        Repair.parse(text)
    assert f"bad part {part!r}" in str(error.value) and "\n" not in str(error.value)


def test_the_empty_setting_is_the_mapped_cache_bit_for_bit(target, source):
    ids, lengths = _prefixes()
    plain = _mapped(target, source).prefix_layers(ids, lengths)
    repaired = _mapped(target, source, "none").prefix_layers(ids, lengths)
    assert all(torch.equal(k, rk) and torch.equal(v, rv) for (k, v), (rk, rv) in zip(plain, repaired))


@pytest.mark.parametrize("repair", [f"layers:{LAYERS}", "sink:19", *(f"tokens:1:{policy}" for policy in POLICIES),
                                    "sink:3+tokens:1:attention", "layers:1+tokens:1:deviation",
                                    "layers:2+tokens:1:key_norm@2"])
def test_a_full_repair_gives_the_oracles_cache_within_float_rounding(target, source, repair):
    ids, lengths = _prefixes()
    oracle = Handoff(target).prefix_layers(ids, lengths)
    mapped = _mapped(target, source).prefix_layers(ids, lengths)
    repaired = _mapped(target, source, repair).prefix_layers(ids, lengths)
    assert _max_error(mapped, oracle, lengths) > 0.1  # the identity map of another model is far from it
    assert _max_error(repaired, oracle, lengths) < 1e-5


def test_exact_layers_replace_those_layers_and_leave_the_rest_mapped(target, source):
    ids, lengths = _prefixes()
    oracle = Handoff(target).prefix_layers(ids, lengths)
    mapped = _mapped(target, source).prefix_layers(ids, lengths)
    repaired = _mapped(target, source, "layers:2").prefix_layers(ids, lengths)
    assert _max_error(repaired[:2], oracle[:2], lengths) < 1e-5
    assert _max_error(repaired[2:], mapped[2:], lengths) == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_partial_repair_changes_exactly_its_chosen_tokens(target, source, policy):
    ids, lengths = _prefixes(batch=1, width=20)
    mapped = _mapped(target, source).prefix_layers(ids, lengths)
    handoff = _mapped(target, source, f"sink:2+tokens:0.25:{policy}")
    repaired = handoff.prefix_layers(ids, lengths)
    changed = {slot for k, rk in ((k, rk) for (k, _), (rk, _) in zip(repaired, mapped))
               for slot in (k[0] != rk[0]).any(dim=(0, 2)).nonzero().flatten().tolist()}
    assert {0, 1} <= changed and len(changed) == 2 + 5  # the sink, then 0.25 x 18 = 4.5 rounded half up
    if policy == "recency":
        assert changed == {0, 1, 15, 16, 17, 18, 19}


def _count_token_layers(model):
    """A counter of the tokens every decoder layer of `model` reads, and the hooks that fill it."""
    seen = [0]
    hooks = [layer.register_forward_hook(lambda module, args, output: seen.__setitem__(
        0, seen[0] + args[0].shape[0] * args[0].shape[1])) for layer in model.model.layers]
    return seen, hooks


@pytest.mark.parametrize("repair, per_layer", [("none", 0), ("sink:3", 3), ("sink:3+tokens:0.25:recency", 3 + 4),
                                               ("tokens:0.25:deviation", 5), ("tokens:0.25:attention", 5 + 1),
                                               ("tokens:0.25:key_norm", 5)])
def test_a_repair_runs_the_target_over_only_the_tokens_it_was_asked_to_recompute(target, source, repair,
                                                                                   per_layer):
    ids, lengths = _prefixes(batch=1, width=20)
    handoff = _mapped(target, source, repair)
    seen, hooks = _count_token_layers(target)
    try:
        handoff.prefix_layers(ids, lengths)
    finally:
        for hook in hooks:
            hook.remove()
    assert seen[0] == per_layer * LAYERS
    assert handoff.repaired.token_layers == seen[0]
    assert handoff.inputs.source_forwards == 1


def test_exact_layers_run_the_target_through_all_but_the_last_of_them_and_never_to_logits(target, source):
    ids, lengths = _prefixes(batch=1, width=20)
    handoff = _mapped(target, source, "layers:2")
    seen, hooks = _count_token_layers(target)
    head = target.lm_head.register_forward_hook(lambda *args: pytest.fail("the repair computed logits"))
    try:
        handoff.prefix_layers(ids, lengths)
    finally:
        for hook in [*hooks, head]:
            hook.remove()
    assert seen[0] == 20 * 1  # layer 0 in full; layer 1's K/V projections only


def _declared_settings() -> list[str]:
    """Every repair setting conf/ declares (grids, select's candidates, evaluate's), as written."""
    found = []
    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        text = yaml.safe_load(path.read_text()) or {}
        sections = [text.get("repair", {}).get("grid"), text.get("select", {}).get("repairs"),
                    list((text.get("evaluate", {}).get("repair") or {}).values())]
        found += [setting for section in sections if section for setting in section if setting != "selected"]
    return sorted(set(found))


def test_conf_declares_repair_settings_for_the_parse_check_below():
    assert {"none", "layers:1", "tokens:0.09:deviation", "sink:4+tokens:0.1:attention"} <= set(_declared_settings())


@pytest.mark.parametrize("text", _declared_settings())
def test_every_declared_setting_prints_back_as_written(text):
    # params, artifact paths and metric keys name settings by these strings: the grammar must keep them
    assert str(Repair.parse(text)) == text


@pytest.mark.parametrize("text, part", [("tokens:0.1:recency@2", "tokens:0.1:recency@2"),
                                        ("tokens:0.1:key_norm@x", "tokens:0.1:key_norm@x")])
def test_a_parameter_a_policy_cannot_take_is_one_line_naming_the_part(text, part):
    with pytest.raises(RepairError) as error:
        Repair.parse(text)
    assert f"bad part {part!r}" in str(error.value) and "\n" not in str(error.value)
