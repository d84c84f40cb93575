"""The handoff modes as a registry (`kv.modes`): each mode one entry with its own `build`, a function of the
handoff's inputs (never of the handoff), the handoff calling it and branching on no mode's name."""
import ast
import json

import pytest
from helpers import ROOT, tiny_config
from helpers.scratch import run_edited

import pipeline.kv.contract as contract_module
from pipeline.kv import entries
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
        entries.register(Mode, "modes", (Mode("", Reads(target=True, source=False, map=False, own=True), own),))
    with pytest.raises(ValueError, match="modes named twice"):
        entries.register(Mode, "modes", (*MODES.values(), MODES["oracle"]))
    assert all(isinstance(mode, Mode) and mode.name == name for name, mode in MODES.items())


def test_a_mode_without_a_build_cannot_be_made():
    with pytest.raises(TypeError, match="build"):
        Mode("hookless", Reads(target=True, source=False, map=False, own=True))


def test_the_contract_judges_each_mode_from_what_it_reads_and_its_own_requirement(monkeypatch):
    def fewer_than_3_layers(source, target):
        return None if target.geometry["layers"] < 3 else "narrow needs a target of fewer than 3 layers"

    narrow = Mode("narrow", MODES["mapped"].reads, mapped, needs_map=True, requirement=fewer_than_3_layers)
    monkeypatch.setattr(contract_module, "MODES", entries.register(Mode, "modes", (*MODES.values(), narrow)))
    source, target = tiny_config(64, 32, layers=2), tiny_config(64, 48, layers=3, num_key_value_heads=1)
    modes = pair_contract(target, source).modes
    assert modes["narrow"] == "narrow needs a target of fewer than 3 layers" and modes["mapped"] is None
    assert "direct injection needs equal KV geometry" in modes["direct"]
    assert modes["oracle"] is None and modes["source"] is None
    alone = pair_contract(target).modes
    assert alone["narrow"] == alone["direct"] == "no source model given" and alone["zero"] is None


HALVED = '''

def halved(inputs: Inputs, prompt: Prompt) -> Built:
    """A scratch mode: the mapped cache with its values halved."""
    built = mapped(inputs, prompt)
    return built._replace(layers=[(keys, values / 2) for keys, values in built.layers])
'''
ENTRY = '    Mode("halved", Reads(target=True, source=True, map=True, own=False), halved, needs_map=True),\n'
EVALUATE = '''
import json
import torch
from helpers import build_model, measure_params, tiny_config
from helpers.report import _fake_variant, report_params
from pathlib import Path
from pipeline.kv.mapper import random_mapper, save_mapper
from pipeline.kv.pair import Pair
from pipeline.measure.evaluation import OracleStore, evaluate
from pipeline.studies import render, variants
from pipeline.studies.run import Run
import numpy as np

target, source = build_model(tiny_config(97, 64), seed=1), build_model(tiny_config(97, 32), seed=2)
pair, mapper = Pair.of(target, source), Path("map.safetensors")
save_mapper(random_mapper(source.config, target.config), mapper)
generator = torch.Generator().manual_seed(0)
prompts = [(torch.randint(0, 97, (12,), generator=generator).tolist(),
            torch.randint(0, 97, (4,), generator=generator).tolist()) for _ in range(6)]
oracle = evaluate(pair.router(mode="oracle"), prompts, store=OracleStore(top_k=5, horizon=2), progress=False)
metrics, items, rows = {}, {}, {}
rng = np.random.default_rng(0)
for name in ("oracle", "source", "selected", "halved"):
    mode = {"selected": "mapped"}.get(name, name)
    request = {"mode": mode, "mapper": mapper} if mode in ("mapped", "halved") else {"mode": mode}
    evaluation = oracle if name == "oracle" else evaluate(pair.router(**request), prompts, oracle.oracle,
                                                         progress=False)
    tasks, items[name], _ = _fake_variant(rng, 0.8, 0.8, 0.8)  # the tasks are not what this shows
    metrics[name] = {**evaluation.figures(), "tasks": tasks["tasks"]}
    rows[name] = evaluation.prompt_rows
run = Run(metrics, items, rows, skipped={}, controls={}, select={}, latency=None, pair=("s", "t"),
          calibration_sizes=[], operating_lengths=[])
context = {"profile": "tiny", "data_kind": "generated", "source": "s", "target": "t", "dtype": "float32",
           "device": "cpu", "pair": ("s", "t"), "selected_name": "selected"}
head = render.head(variants.compute(report_params(), measure_params(), run), context)
print(json.dumps({"row": [line for line in head.splitlines() if line.startswith("| halved |")],
                  "perplexity": {name: metrics[name]["prompts"]["perplexity"] for name in metrics}}))
'''


def test_a_mode_added_to_the_registry_alone_is_evaluated_and_reaches_the_reports_table_by_its_own_name(tmp_path):
    """In a scratch copy, one function and one registry line in kv/modes.py, no other file: a pair serves the new
    mode, an evaluation scores it against the oracle, and the report's table has its row."""
    edits = {"pipeline/kv/modes.py": [("\n\nMODES = ", HALVED + "\n\nMODES = "),
                                      ("\n))\nSOURCE_MODES", "\n" + ENTRY + "))\nSOURCE_MODES")]}
    shown = json.loads(run_edited(ROOT, tmp_path, edits, EVALUATE).splitlines()[-1])
    assert shown["row"]  # | halved | perplexity | top-1 | ... in the report's tables
    perplexity = shown["perplexity"]
    assert f"| halved | {perplexity['halved']:.4f} |" in shown["row"][0]
    assert perplexity["halved"] != perplexity["selected"]  # its own cache, not the mapped one
