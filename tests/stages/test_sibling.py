"""Stage `sibling` on a tiny generated Llama target (no network): the smol profile's sibling is the stored shape and
costs at most 0.40 of the target's prefill (and passes check_params as the source), two builds are byte-identical,
a depth sibling keeps the layers of highest influence or those declared, any other source costs only a marker file,
and a bad shape is one line."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml
from dvc.utils.hydra import compose_and_dump
from helpers import ROOT
from helpers.kvworld import VOCAB
from helpers.sibling import HEAD_DIM, KV_HEADS, LAYERS, project_folder, sibling_params
from transformers import LlamaForCausalLM

from pipeline import sibling as stage
from pipeline.check_params import check
from pipeline.fitting.prune import choose_layers
from pipeline.store import paths
from pipeline.store.models import ModelsParams
from pipeline.store.params import ParamError, parse


def models(source: str) -> ModelsParams:
    return parse(ModelsParams, dict(kind="hub", source=source, target="models/target", source_revision=None,
                                    target_revision=None, dtype="float32", device_map=None), "models")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    return project_folder(tmp_path_factory.mktemp("sibling"))


@pytest.mark.parametrize("shape", ["mlp:320+heads:6", "layers:12", "layers:20+mlp:768+heads:6"])
def test_the_smol_profile_with_the_sibling_as_its_source_passes_check_params_at_each_shape(tmp_path, shape):
    out = tmp_path / "params.yaml"
    compose_and_dump(out, str(ROOT / "conf"), None, "config", "",
                     ["profile=smol", "models.source=models/sibling", f"sibling.shape={shape}"])
    params = yaml.safe_load(out.read_text())
    assert params["sibling"]["shape"] == shape and sorted(check(params)) == sorted(params)


def build(project: Path, source: str, monkeypatch, **changes) -> dict:
    monkeypatch.chdir(project)
    return stage.run(sibling_params(**changes), models(source), 1, paths.CALIBRATION_POOL, paths.split("select"),
                     paths.SIBLING)


def files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_two_builds_give_byte_identical_folders_a_loadable_checkpoint_and_its_figures(project, monkeypatch):
    first = build(project, "models/sibling", monkeypatch, steps=6)
    kept = files(project / paths.SIBLING)
    second = build(project, "models/sibling", monkeypatch, steps=6)
    assert files(project / paths.SIBLING) == kept
    assert {key: value for key, value in first.items() if key not in ("build_seconds", "curve")} == \
        {key: value for key, value in second.items() if key not in ("build_seconds", "curve")}
    assert kept["tokenizer.json"] == (project / "models/target/tokenizer.json").read_bytes()
    reloaded = LlamaForCausalLM.from_pretrained(project / paths.SIBLING)
    assert (reloaded.config.num_hidden_layers, reloaded.config.intermediate_size,
            reloaded.config.num_attention_heads) == (LAYERS, 16, 2)
    assert first["shape"] == {"shape": "mlp:16+heads:2", "layers": list(range(LAYERS)), "intermediate_size": 16,
                              "query_heads": 2, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "hidden_size": 32}
    assert {"built", "select_perplexity", "target_select_perplexity", "prefill_ratio", "build_seconds"} <= set(first)
    assert first["built"] and first["steps"] == 6 and 0 < first["prefill_ratio"] < 0.6
    assert json.loads(kept[stage.SIBLING_PROVENANCE])["shape"] == first["shape"]
    mask = os.umask(0o077)
    os.umask(mask)
    assert {stat.S_IMODE((project / paths.SIBLING / name).stat().st_mode) for name in kept} == {0o666 & ~mask}


def test_a_depth_sibling_keeps_the_layers_of_highest_influence_or_those_declared(project, monkeypatch):
    chosen = build(project, "models/sibling", monkeypatch, shape="layers:3", steps=0)
    assert chosen["layers_rule"] == "influence" and chosen["shape"]["layers"][0] == 0
    assert chosen["shape"]["layers"] == choose_layers(chosen["influence"], 3)
    declared = build(project, "models/sibling", monkeypatch, shape="layers:3", keep=[0, 1, 5], steps=0)
    assert declared["shape"]["layers"] == [0, 1, 5] and declared["layers_rule"] == "declared"
    assert LlamaForCausalLM.from_pretrained(project / paths.SIBLING).config.num_hidden_layers == 3


def test_any_other_source_gets_the_marker_alone_and_loads_nothing(project, monkeypatch):
    monkeypatch.setattr(stage, "load_model", None)  # a call would raise
    result = build(project, "self:2", monkeypatch)
    assert result == {"built": False, "source": "self:2"}
    assert files(project / paths.SIBLING) == {stage.SIBLING_PROVENANCE: b'{"built": false}\n'}


@pytest.mark.parametrize("changes, message", [
    (dict(shape="layers:3", keep=[0, 2, 9]), r"^sibling\.keep: \[0, 2, 9\] names a layer outside the target's 6 "),
    (dict(shape="mlp:128"), r"^sibling\.shape: mlp:128, but the target has 64 MLP channels per layer \(models/targ"),
    (dict(shape="heads:3"), r"^sibling\.shape: heads:3 is not a multiple of the target's 2 KV heads"),
    (dict(shape="layers:7"), r"^sibling\.shape: layers:7, but the target has 6 decoder layers"),
    (dict(shape="layers:6+mlp:64"), r"^sibling\.shape: layers:6\+mlp:64 keeps the whole target"),
    (dict(top_k=VOCAB), rf"^sibling\.top_k: {VOCAB}, but the target's vocabulary has {VOCAB} tokens"),
])
def test_a_shape_the_target_does_not_have_is_refused_in_one_line_before_its_weights_load(project, monkeypatch,
                                                                                          changes, message):
    monkeypatch.setattr(stage, "load_model", None)  # a call would raise
    with pytest.raises(ParamError, match=message) as refusal:
        build(project, "models/sibling", monkeypatch, **changes)
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize("changes, message", [
    (dict(shape="layers:3", keep=[0, 3]), r"^sibling\.keep: 2 layers listed but sibling\.shape keeps layers:3"),
    (dict(shape="layers:3", keep=[0, 3, 3]), r"^sibling\.keep: \[0, 3, 3\] is not strictly ascending"),
    (dict(keep=[0, 3]), r"^sibling\.keep: \[0, 3\] lists layers, but sibling\.shape 'mlp:16\+heads:2' keeps them"),
    (dict(keep="first"), r"^sibling\.keep"),
    (dict(shape="layers:1"), r"^sibling\.shape: 'layers:1': a sibling keeps at least 2 decoder layers"),
    (dict(shape="width:3"), r"^sibling\.shape: 'width:3': bad part 'width:3' \(parts joined by \+"),
    (dict(shape="mlp:16+mlp:8"), r"^sibling\.shape: 'mlp:16\+mlp:8': bad part 'mlp:8'"),
    (dict(shape="heads:0"), r"^sibling\.shape: 'heads:0': bad part"),
    (dict(shape="heads"), r"^sibling\.shape: 'heads': bad part"),
])
def test_a_malformed_shape_or_layer_list_is_refused_by_the_params_in_one_line(changes, message):
    with pytest.raises(ParamError, match=message) as refusal:
        sibling_params(**changes)
    assert "\n" not in str(refusal.value)


def test_the_stage_refuses_a_sibling_of_a_model_that_is_not_a_checkpoint(project, monkeypatch):
    monkeypatch.chdir(project)
    trained = models("models/sibling").model_copy(update={"kind": "trained"})
    with pytest.raises(ParamError, match=r"^models\.source: models/sibling is the sibling.*models\.kind is 'trained'"):
        stage.run(sibling_params(), trained, 1, paths.CALIBRATION_POOL, paths.split("select"), paths.SIBLING)
