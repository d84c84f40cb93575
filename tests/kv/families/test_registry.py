"""The mapper families' registry and map names (`kv/families/registry.py`): every list of families is the
registry's, the contract judges each, and a name is built and read in one place."""
from __future__ import annotations

import pytest
from helpers import tiny_config

from pipeline.kv.contract import pair_contract
from pipeline.kv.families.maths import registry as maths_registry
from pipeline.kv.families.maths.registry import FAMILY_MATHS
from pipeline.kv.families.registry import CLOSED_FORM, FAMILIES, FITTED_FAMILIES, TRAINABLE, MapName


@pytest.mark.parametrize("name", ["linear_k1_lam0.001", "head_matched_k3_lam1e-05", "mlp_k3", "mlp_k3+kl",
                                  "low_rank_k1_r16_lam0.001", "low_rank_k2_r4_lam1e-05+kl", "linear_k4_lam0"])
def test_a_map_name_reads_back_to_the_same_text(name):
    parsed = MapName.parse(name)
    assert str(parsed) == name
    assert parsed.distilled == name.endswith("+kl") and str(parsed.start) == name.removesuffix("+kl")


def test_a_low_rank_name_is_not_read_as_a_family_named_low():
    parsed = MapName.parse("low_rank_k1_r8_lam0.1")
    assert (parsed.family, parsed.k, parsed.rank, parsed.ridge_lambda) == ("low_rank", 1, 8, 0.1)


@pytest.mark.parametrize("name", ["low_k1", "linear_k1", "mlp_k1_lam0.1", "linear_kx_lam1", "identity", "rank_k1"])
def test_a_name_no_family_makes_is_refused_naming_the_forms(name):
    with pytest.raises(ValueError, match="is not a map name.*low_rank_k1_r8_lam0.001"):
        MapName.parse(name)


def test_the_family_lists_are_the_registrys():
    assert set(CLOSED_FORM) | {"mlp"} == set(FITTED_FAMILIES) and set(FITTED_FAMILIES) < set(FAMILIES)
    assert "identity" not in TRAINABLE and {"linear", "head_matched", "mlp", "low_rank"} <= set(TRAINABLE)


def test_the_maths_registry_names_every_declared_family_and_refuses_one_without_maths():
    assert list(FAMILY_MATHS) == list(FAMILIES)
    assert all(FAMILY_MATHS[name].declaration is FAMILIES[name] for name in FAMILIES)
    with pytest.raises(ValueError, match=r"^'mlp' is declared \(kv.families.registry\) but has no maths"):
        maths_registry.register(*(maths for name, maths in FAMILY_MATHS.items() if name != "mlp"))


def test_the_contract_judges_every_registered_family():
    source, target = tiny_config(64, 32, layers=2), tiny_config(64, 48, layers=3, num_key_value_heads=1)
    contract = pair_contract(target, source)
    assert list(contract.families) == list(FAMILIES)
    assert contract.families["linear"] is None and contract.families["low_rank"] is None
    assert "equal KV head counts" in contract.families["head_matched"]
