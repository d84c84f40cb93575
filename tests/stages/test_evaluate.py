"""The evaluate stage's command line: several variants in one process, the oracle first, an unknown name refused
before any work; a repaired variant is the handoff with its setting (or select's), a malformed one refused."""
import json

import pandas as pd
import pytest
import yaml
from helpers import ROOT

from pipeline.evaluate import ordered_variants, variant_request
from pipeline.kv.handoff import Handoff
from pipeline.kv.mapper import random_mapper, save_mapper
from pipeline.kv.modes import BASELINES
from pipeline.kv.pair import Pair
from pipeline.kv.repair import Repair
from pipeline.measure.compare import oracle_outputs, variant_rows
from pipeline.schema.evaluate import EvaluateParams
from pipeline.store import paths
from pipeline.store.artifacts import ArtifactError
from pipeline.store.fingerprints import pair_fingerprints
from pipeline.store.params import ParamError, parse

PARAMS = EvaluateParams(mapped={"selected": "models/mapper.safetensors"}, repair={}, top_k=4, horizon=2,
                        batch_size=2, shuffle_seed=0, processes=1)


def test_the_oracle_runs_first_and_each_variant_once():
    assert ordered_variants(["zero", "selected", "oracle", "zero", "direct"], PARAMS) == \
        ["oracle", "zero", "selected", "direct"]
    assert ordered_variants(["selected"], PARAMS) == ["selected"]


@pytest.mark.parametrize("name", ["oracle2", "mapped_k7", ""])
def test_a_variant_that_is_neither_a_baseline_nor_a_mapped_key_is_refused_by_name(name):
    with pytest.raises(ParamError, match=rf"^pipeline\.evaluate: unknown variant {name!r}; name a baseline"):
        ordered_variants(["oracle", name], PARAMS)


def test_the_evaluate_stage_runs_every_baseline_and_declares_each_ones_outputs():
    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["evaluate"]
    assert stage["cmd"].split()[3:] == list(BASELINES) == ["oracle", "direct", "source", "zero"]
    outs = {out if isinstance(out, str) else next(iter(out)) for out in stage["outs"] + stage["metrics"]}
    for variant in BASELINES:
        assert {f"eval/{variant}", str(paths.variant_metrics(variant))} <= outs


@pytest.fixture(scope="module")
def mapped_pair(wide_pair, tmp_path_factory) -> tuple:
    """wide_pair loaded, with a random k=1 map bound to it on disk."""
    pair = Pair(str(wide_pair["target"]), str(wide_pair["source"]), "float32", "cpu")
    mapper = random_mapper(pair.source.config, pair.target.config, k=1, seed=0)
    mapper.models = pair_fingerprints(str(wide_pair["source"]), str(wide_pair["target"]))
    path = tmp_path_factory.mktemp("evaluate") / "k1.safetensors"
    save_mapper(mapper, path)
    return pair, path


def evaluated(handoff) -> pd.DataFrame:
    """A handoff's per-prompt rows against the oracle on a few prompts (`measure.compare`)."""
    prompts = [(list(range(3 + i, 15 + 2 * i)), [5, 6, 7, 8]) for i in range(3)]
    oracle = oracle_outputs(Handoff(handoff.decoder), prompts, 8, 4, 2, progress=False)
    return variant_rows(handoff, prompts, oracle, 2, progress=False)


def test_a_repaired_variant_is_the_handoff_with_its_setting_and_an_unnamed_one_stays_unrepaired(mapped_pair):
    pair, path = mapped_pair
    params = PARAMS.model_copy(update={"mapped": {"plain": str(path), "fixed": str(path)},
                                       "repair": {"fixed": "tokens:0.5:recency"}})
    fixed, plain = (pair.router(**variant_request(name, params)).handoff for name in ("fixed", "plain"))
    assert str(fixed.repair) == "tokens:0.5:recency" and plain.repair.empty
    rows = evaluated(fixed)
    pd.testing.assert_frame_equal(rows, evaluated(pair.handoff("mapped", path, repair=fixed.repair)))
    assert not rows.equals(evaluated(plain))
    pd.testing.assert_frame_equal(evaluated(plain), evaluated(pair.handoff("mapped", path)))


def test_selected_reads_the_setting_select_chose(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    selected = str(paths.SELECTED_MAPPER)
    params = PARAMS.model_copy(update={"mapped": {"selected": selected, "repaired": selected},
                                       "repair": {"repaired": "selected"}})
    with pytest.raises(ArtifactError, match=r"^evaluate\.repair\.repaired: models/mapper_repair\.json not found; run"):
        variant_request("repaired", params)
    paths.MODELS.mkdir()
    chosen = {"map": "m", "repair": "layers:1+tokens:0.09:deviation", "budget": 0.09}
    paths.SELECTED_REPAIR.write_text(json.dumps(chosen))
    paths.SELECTED_MAPPER.touch()  # the request checks the file is there; nothing loads it
    request = variant_request("repaired", params)
    assert str(request["repair"]) == "layers:1+tokens:0.09:deviation" and request["speculative"] is None
    unrepaired = variant_request("selected", params)
    assert (unrepaired["repair"], unrepaired["speculative"]) == (Repair(), None)


def test_a_selected_repair_ranking_by_the_source_reads_the_settings_select_scored_it_under(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    selected = str(paths.SELECTED_MAPPER)
    params = PARAMS.model_copy(update={"mapped": {"repaired": selected}, "repair": {"repaired": "selected"}})
    paths.MODELS.mkdir()
    settings = {"last": 3, "sinks": 1, "layers": [-1], "pooling": "mean"}
    chosen = {"map": "m", "repair": "tokens:0.08:source_attention", "budget": 0.09, "speculative": settings}
    paths.SELECTED_REPAIR.write_text(json.dumps(chosen))
    paths.SELECTED_MAPPER.touch()  # the request checks the file is there; nothing loads it
    request = variant_request("repaired", params)
    assert str(request["repair"]) == "tokens:0.08:source_attention" and request["speculative"].model_dump() == settings
    paths.SELECTED_REPAIR.write_text(json.dumps({**chosen, "speculative": None}))  # written without them: refused
    with pytest.raises(ArtifactError, match=r"^evaluate\.repair\.repaired: models/mapper_repair\.json chose "
                                            r"tokens:0\.08:source_attention, .* holds no `speculative` settings"):
        variant_request("repaired", params)


@pytest.mark.parametrize("mapped, repair, message", [
    ({"selected": "models/mapper.safetensors"}, {"other": "layers:1"}, r"^evaluate\.repair\.other: not a variant of"),
    ({"shuffled": "models/mapper.safetensors"}, {"shuffled": "layers:1"},
     r"^evaluate\.repair\.shuffled: the shuffled-cache null control takes no repair"),
    ({"k1": "models/best/mapped_k1.safetensors"}, {"k1": "selected"},
     r"^evaluate\.repair\.k1: `selected` is the setting select chose for models/mapper\.safetensors"),
    ({"k1": "models/best/mapped_k1.safetensors"}, {"k1": "tokens:0.1"},
     r"^evaluate\.repair\.k1: repair 'tokens:0\.1': bad"),
    ({"k1": "models/best/mapped_k1.safetensors"}, {"k1": "tokens:0.1:source_attention"},
     r"^evaluate\.repair\.k1: policy source_attention reads params' `speculative` settings, which evaluate does not"),
])
def test_a_malformed_repaired_variant_is_refused_in_one_line_naming_the_key(mapped, repair, message):
    with pytest.raises(ParamError, match=message):
        parse(EvaluateParams, {**PARAMS.model_dump(), "mapped": mapped, "repair": repair}, "evaluate")
