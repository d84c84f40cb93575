"""The handoff modes as a registry (`kv.modes`): each mode one entry with its own `build`, a function of the
handoff's inputs (never of the handoff), the handoff calling it and branching on no mode's name."""
import ast

import pytest
from helpers import ROOT, tiny_config

import pipeline.kv.contract as contract_module
from pipeline.kv.contract import pair_contract
from pipeline.kv.modes import (
    BASELINES,
    MAPPER_MODES,
    MODES,
    OWN_MODES,
    SOURCE_MODES,
    Mode,
    Reads,
    mapped,
    own,
    register,
    split_mode,
)


def test_the_handoff_branches_on_no_mode_name_and_no_mode_calls_back_into_it():
    text = (ROOT / "pipeline" / "kv" / "handoff.py").read_text()
    assert "mode ==" not in text and "mode in" not in text and "mode !=" not in text
    # a mode is a function of the handoff's inputs: no function of kv.modes takes the handoff (kv.handoff comes
    # after kv.modes in WINGS, so it cannot import it either)
    tree = ast.parse((ROOT / "pipeline" / "kv" / "modes.py").read_text())
    arguments = {arg.arg for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) for arg in node.args.args}
    assert "handoff" not in arguments and {"inputs", "prompt"} <= arguments


def test_every_list_of_modes_is_derived_from_the_entries():
    assert list(MODES) == ["oracle", "zero", "source", "direct", "mapped", "shuffled", "speculative"]
    assert OWN_MODES == ("oracle", "source") and all(MODES[name].build is own for name in OWN_MODES)
    assert SOURCE_MODES == ("direct", "mapped", "shuffled") and MAPPER_MODES == ("mapped", "shuffled")
    assert BASELINES == ("oracle", "direct", "source", "zero")


def test_speculative_reads_the_source_hands_nothing_over_and_is_no_baseline_for_it_takes_a_value():
    speculative = MODES["speculative"]
    assert speculative.reads.source and speculative.reads.target and not speculative.hands_over
    assert speculative.sparse and speculative.parameter and "speculative" not in BASELINES
    assert split_mode("speculative:0.1") == ("speculative", "0.1") and split_mode("oracle") == ("oracle", None)


def test_shuffled_and_the_own_modes_need_no_mapper():
    assert [name for name in MODES if MODES[name].needs_map] == ["mapped"]


def test_the_registry_refuses_an_unnamed_entry_or_a_name_twice():
    with pytest.raises(TypeError, match="is not a named kv.modes.Mode instance"):
        register(Mode("", Reads(target=True, source=False, map=False, own=True), own))
    with pytest.raises(ValueError, match="modes named twice"):
        register(*MODES.values(), MODES["oracle"])
    assert all(isinstance(mode, Mode) and mode.name == name for name, mode in MODES.items())


def test_a_mode_without_a_build_cannot_be_made():
    with pytest.raises(TypeError, match="build"):
        Mode("hookless", Reads(target=True, source=False, map=False, own=True))


def test_the_contract_judges_each_mode_from_what_it_reads_and_its_own_requirement(monkeypatch):
    def fewer_than_3_layers(source, target):
        return None if target.geometry["layers"] < 3 else "narrow needs a target of fewer than 3 layers"

    narrow = Mode("narrow", MODES["mapped"].reads, mapped, needs_map=True, requirement=fewer_than_3_layers)
    monkeypatch.setattr(contract_module, "MODES", register(*MODES.values(), narrow))
    source, target = tiny_config(64, 32, layers=2), tiny_config(64, 48, layers=3, num_key_value_heads=1)
    modes = pair_contract(target, source).modes
    assert modes["narrow"] == "narrow needs a target of fewer than 3 layers" and modes["mapped"] is None
    assert "direct injection needs equal KV geometry" in modes["direct"]
    assert modes["oracle"] is None and modes["source"] is None
    alone = pair_contract(target).modes
    assert alone["narrow"] == alone["direct"] == "no source model given" and alone["zero"] is None
