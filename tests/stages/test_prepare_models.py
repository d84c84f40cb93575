"""Stage prepare_models: pointers to a local pair load offline and a moved checkpoint is named; a random pair is
recorded by its shapes and an unknown shape refused."""
import json
import shutil

import pytest
import yaml
from helpers import ROOT, committed, pin_and_prepare

from pipeline import prepare_models
from pipeline.schema.prepare_models import TrainParams
from pipeline.store.models import ModelNotAvailableError, ModelsParams, load_config, load_model, load_tokenizer
from pipeline.store.params import parse


def test_prepared_pointers_to_a_local_pair_load_offline_and_a_moved_folder_is_named(tmp_path, monkeypatch, capsys):
    for name in ("source", "target"):
        shutil.copytree(ROOT / "models" / name, tmp_path / "ckpt" / name)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["models"] = committed("models", kind="hub", source=str(tmp_path / "ckpt" / "source"),
                                 target=str(tmp_path / "ckpt" / "target"))
    # both stages run as dvc runs them, in the working directory: their paths (models/pins.json, models/<side>)
    # are relative and fixed at import, so moving the directory, not patching a module's MODELS, moves them all
    pin_and_prepare(tmp_path, params, monkeypatch)
    for name in ("source", "target"):
        pointer = json.loads((tmp_path / "models" / name / "local.json").read_text())
        assert pointer["path"] == f"ckpt/{name}"  # inside the working directory: relative, alike in every clone
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert printed["kind"] == "hub"
    assert printed["modes"] == ["direct", "mapped", "oracle", "shuffled", "source", "speculative", "zero"]
    model = load_model(str(tmp_path / "models" / "target"), device="cpu")
    assert model.config.num_hidden_layers == load_config(str(ROOT / "models" / "target")).num_hidden_layers
    (tmp_path / "ckpt").rename(tmp_path / "elsewhere")
    with pytest.raises(ModelNotAvailableError, match="ckpt/target .*gone or has moved"):
        load_model(str(tmp_path / "models" / "target"), device="cpu")


def train_params() -> TrainParams:
    return parse(TrainParams, committed("train"), "train")


def random_pair(root, tokenizer, monkeypatch, target: str) -> ModelsParams:
    """The models section of a random pair (qwen3-0.6b, `target`), run from `root` with the tiny tokenizer there."""
    monkeypatch.chdir(root)  # store.paths are relative to the repository root, where stages run
    tokenizer.save_pretrained(root / "data" / "tokenizer")
    return parse(ModelsParams, committed("models", kind="random", source="qwen3-0.6b", target=target), "models")


def test_random_pointer_loads_the_named_shape(tmp_path, tokenizer, monkeypatch):
    models = random_pair(tmp_path, tokenizer, monkeypatch, "qwen3-1.7b")
    prepare_models.prepare(models, train_params(), 1)
    pointer = json.loads((tmp_path / "models" / "target" / "random.json").read_text())
    assert pointer == {"shape": "qwen3-1.7b", "seed": 1}
    assert len(load_tokenizer(str(tmp_path / "models" / "source"))) == len(tokenizer)


def test_unknown_shape_is_refused(tmp_path, tokenizer, monkeypatch):
    models = random_pair(tmp_path, tokenizer, monkeypatch, "qwen3-17b")
    with pytest.raises(ValueError, match="qwen3-17b"):
        prepare_models.prepare(models, train_params(), 1)
