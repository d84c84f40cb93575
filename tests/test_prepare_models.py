"""Stage prepare_models: the V0 pair fails clearly without the hub; pointers load like models."""
import json

import pytest
from conftest import committed

from pipeline import prepare_models
from pipeline.store.models import ModelNotAvailableError, ModelsParams, load_model, load_tokenizer
from pipeline.store.params import ParamError, parse


def test_v0_pair_offline_fails_fast_naming_the_model(tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_models, "MODELS", tmp_path / "models")
    models = parse(ModelsParams,
                   committed("models", **{"kind": "hub", "source": "Qwen/Qwen3-0.6B", "target": "Qwen/Qwen3-1.7B"}),
                   "models")
    with pytest.raises(ModelNotAvailableError, match="Qwen/Qwen3-0.6B"):
        prepare_models.pin_hub_pair(models)
    assert not (tmp_path / "models").exists()  # nothing half-written


def test_hub_pointer_offline_names_the_model(tmp_path):
    (tmp_path / "hub.json").write_text(json.dumps({"id": "Qwen/Qwen3-1.7B", "revision": "abc123"}))
    with pytest.raises(ModelNotAvailableError, match="Qwen/Qwen3-1.7B.*abc123"):
        load_model(str(tmp_path))
    with pytest.raises(ModelNotAvailableError, match="Qwen/Qwen3-1.7B"):
        load_tokenizer(str(tmp_path))


def test_random_pointer_loads_the_named_shape(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(prepare_models, "MODELS", tmp_path / "models")
    monkeypatch.setattr(prepare_models, "DATA", tmp_path / "data")
    tokenizer.save_pretrained(tmp_path / "data" / "tokenizer")
    models = parse(ModelsParams,
                   committed("models", **{"kind": "random", "source": "qwen3-0.6b", "target": "qwen3-1.7b"}),
                   "models")
    prepare_models.record_random_pair(models)
    pointer = json.loads((tmp_path / "models" / "target" / "random.json").read_text())
    assert pointer == {"shape": "qwen3-1.7b", "seed": 1}
    assert len(load_tokenizer(str(tmp_path / "models" / "source"))) == len(tokenizer)


def test_unknown_shape_is_refused(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(prepare_models, "MODELS", tmp_path / "models")
    monkeypatch.setattr(prepare_models, "DATA", tmp_path / "data")
    tokenizer.save_pretrained(tmp_path / "data" / "tokenizer")
    models = parse(ModelsParams,
                   committed("models", **{"kind": "random", "source": "qwen3-0.6b", "target": "qwen3-17b"}),
                   "models")
    with pytest.raises(ValueError, match="qwen3-17b"):
        prepare_models.record_random_pair(models)


def test_models_params_are_validated():
    with pytest.raises(ParamError, match=r"models\.kind: expected one of"):
        parse(ModelsParams, committed("models", **{"kind": "downloaded", "source": "a", "target": "b"}), "models")
    with pytest.raises(ParamError, match=r"models\.dtyp: unknown parameter"):
        parse(ModelsParams, committed("models", **{"kind": "hub", "source": "a", "target": "b", "dtyp": "float32"}),
              "models")
