"""Model loading (`store.models`): what a name means, a pointer without its model, a device map, and the models
params."""
import json

import pytest
from helpers import ROOT, committed

from pipeline.store.models import ModelNotAvailableError, ModelsParams, load_model, load_tokenizer, looks_like_path
from pipeline.store.params import ParamError, parse


@pytest.mark.parametrize("name, is_path", [
    ("Qwen/Qwen3-1.7B", False), ("gpt2", False), ("./qwen3", True), ("../models/qwen3", True), ("/data/qwen3", True),
    ("~/qwen3", True), ("runs/2024/qwen3", True), ("qwen3/", True), ("C:\\models\\qwen3", True),
    ("models/target", True),  # the repository's models/ folder exists: a stage's prepared model, not a hub owner
])
def test_a_name_is_a_path_when_it_cannot_be_a_hub_id_or_its_first_part_is_a_local_folder(name, is_path,
                                                                                          monkeypatch):
    monkeypatch.chdir(ROOT)
    assert looks_like_path(name) is is_path


def test_a_device_map_for_a_random_model_is_refused_by_its_key(tmp_path):
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "random.json").write_text(json.dumps({"shape": "qwen3-0.6b", "seed": 0}))
    with pytest.raises(ParamError, match="models.device_map: 'auto' needs a checkpoint"):
        load_model(str(tmp_path / "random"), device_map="auto")


def test_hub_pointer_offline_names_the_model(tmp_path):
    (tmp_path / "hub.json").write_text(json.dumps({"id": "Qwen/Qwen3-1.7B", "revision": "abc123"}))
    with pytest.raises(ModelNotAvailableError, match="Qwen/Qwen3-1.7B.*abc123"):
        load_model(str(tmp_path))
    with pytest.raises(ModelNotAvailableError, match="Qwen/Qwen3-1.7B"):
        load_tokenizer(str(tmp_path))


def test_models_params_are_validated():
    with pytest.raises(ParamError, match=r"models\.kind: expected one of"):
        parse(ModelsParams, committed("models", **{"kind": "downloaded", "source": "a", "target": "b"}), "models")
    with pytest.raises(ParamError, match=r"models\.dtyp: unknown parameter"):
        parse(ModelsParams, committed("models", **{"kind": "hub", "source": "a", "target": "b", "dtyp": "float32"}),
              "models")
