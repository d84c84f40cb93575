"""Stages pin_models and prepare_models: the V0 pair fails clearly without the hub; a local checkpoint or a cached
hub id is pinned offline; pointers load like models; a moved checkpoint is named."""
import json
import shutil

import pytest
import yaml
from helpers import ROOT, committed, pin_and_prepare
from huggingface_hub import constants as hf_constants

from pipeline import pin_models, prepare_models
from pipeline.store.models import (
    ModelFolderError,
    ModelNotAvailableError,
    ModelsParams,
    load_config,
    load_model,
    load_tokenizer,
)
from pipeline.store.params import ParamError, parse


def hub_models(source: str, target: str) -> ModelsParams:
    return parse(ModelsParams, committed("models", **{"kind": "hub", "source": source, "target": target}), "models")


def test_v0_pair_offline_fails_fast_naming_the_model():
    with pytest.raises(ModelNotAvailableError, match="Qwen/Qwen3-0.6B"):
        pin_models.pins(hub_models("Qwen/Qwen3-0.6B", "Qwen/Qwen3-1.7B"))


def test_a_local_checkpoint_is_pinned_by_path_and_content_and_one_changed_byte_changes_its_pin(tmp_path):
    folder = shutil.copytree(ROOT / "models" / "target", tmp_path / "ckpt")
    pinned = pin_models.pin(str(folder), None)
    assert pinned["kind"] == "local" and pinned["path"] == str(folder.resolve()) and len(pinned["sha256"]) == 64
    (folder / ".cache").mkdir()
    (folder / ".cache" / "lock").write_text("tool state, not the checkpoint")
    assert pin_models.pin(str(folder), None) == pinned
    weights = bytearray((folder / "model.safetensors").read_bytes())
    weights[-1] ^= 0x01
    (folder / "model.safetensors").write_bytes(bytes(weights))
    assert pin_models.pin(str(folder), None)["sha256"] != pinned["sha256"]


def test_a_checkpoint_inside_the_working_directory_is_pinned_by_a_relative_path_alike_in_every_clone(
        tmp_path, monkeypatch):
    pinned = []
    for clone in ("one", "two"):
        shutil.copytree(ROOT / "models" / "target", tmp_path / clone / "models" / "converted")
        monkeypatch.chdir(tmp_path / clone)
        pinned.append(pin_models.pin("models/converted", None))
        pinned.append(pin_models.pin(str(tmp_path / clone / "models" / "converted"), None))
    assert pinned[0]["path"] == "models/converted" and len({json.dumps(pin) for pin in pinned}) == 1


@pytest.mark.parametrize("damage", ["no weights", "truncated weights"])
def test_a_folder_without_complete_weights_is_not_pinned(damage, tmp_path):
    folder = shutil.copytree(ROOT / "models" / "target", tmp_path / "ckpt")
    weights = folder / "model.safetensors"
    if damage == "no weights":
        weights.unlink()
    else:
        weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ModelFolderError, match=rf"^model folder {folder} (holds no weights|has incomplete weights: "
                                               rf"model\.safetensors holds \d+ bytes where its header describes)"):
        pin_models.pin(str(folder), None)


def test_a_local_checkpoint_pin_leaves_out_files_that_are_no_part_of_its_fingerprint(tmp_path):
    folder = shutil.copytree(ROOT / "models" / "target", tmp_path / "ckpt")
    pinned = pin_models.pin(str(folder), None)
    (folder / "NOTES.md").write_text("converted on a laptop; see the model card\n")
    (folder / "train_stats.json").write_text("{}")
    assert pin_models.pin(str(folder), None) == pinned
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.7}))
    assert pin_models.pin(str(folder), None)["sha256"] != pinned["sha256"]


def test_a_hub_id_in_the_local_cache_is_pinned_offline_to_its_cached_commit(tmp_path, monkeypatch):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--someone--tiny-target"
    shutil.copytree(ROOT / "models" / "target", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pinned = pin_models.pin("someone/tiny-target", None)
    assert pinned == {"kind": "hub", "id": "someone/tiny-target", "revision": commit}
    assert load_config("someone/tiny-target", commit).num_hidden_layers == 3


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
    assert printed["modes"] == ["direct", "mapped", "oracle", "shuffled", "source", "zero"]
    model = load_model(str(tmp_path / "models" / "target"), device="cpu")
    assert model.config.num_hidden_layers == load_config(str(ROOT / "models" / "target")).num_hidden_layers
    (tmp_path / "ckpt").rename(tmp_path / "elsewhere")
    with pytest.raises(ModelNotAvailableError, match="ckpt/target .*gone or has moved"):
        load_model(str(tmp_path / "models" / "target"), device="cpu")


def test_hub_pointer_offline_names_the_model(tmp_path):
    (tmp_path / "hub.json").write_text(json.dumps({"id": "Qwen/Qwen3-1.7B", "revision": "abc123"}))
    with pytest.raises(ModelNotAvailableError, match="Qwen/Qwen3-1.7B.*abc123"):
        load_model(str(tmp_path))
    with pytest.raises(ModelNotAvailableError, match="Qwen/Qwen3-1.7B"):
        load_tokenizer(str(tmp_path))


def test_random_pointer_loads_the_named_shape(tmp_path, tokenizer, monkeypatch):
    monkeypatch.chdir(tmp_path)  # store.paths are relative to the repository root, where stages run
    tokenizer.save_pretrained(tmp_path / "data" / "tokenizer")
    models = parse(ModelsParams,
                   committed("models", **{"kind": "random", "source": "qwen3-0.6b", "target": "qwen3-1.7b"}),
                   "models")
    prepare_models.record_random_pair(models, committed("train")["random_seed"])
    pointer = json.loads((tmp_path / "models" / "target" / "random.json").read_text())
    assert pointer == {"shape": "qwen3-1.7b", "seed": 1}
    assert len(load_tokenizer(str(tmp_path / "models" / "source"))) == len(tokenizer)


def test_unknown_shape_is_refused(tmp_path, tokenizer, monkeypatch):
    monkeypatch.chdir(tmp_path)  # store.paths are relative to the repository root, where stages run
    tokenizer.save_pretrained(tmp_path / "data" / "tokenizer")
    models = parse(ModelsParams,
                   committed("models", **{"kind": "random", "source": "qwen3-0.6b", "target": "qwen3-17b"}),
                   "models")
    with pytest.raises(ValueError, match="qwen3-17b"):
        prepare_models.record_random_pair(models, 0)


def test_models_params_are_validated():
    with pytest.raises(ParamError, match=r"models\.kind: expected one of"):
        parse(ModelsParams, committed("models", **{"kind": "downloaded", "source": "a", "target": "b"}), "models")
    with pytest.raises(ParamError, match=r"models\.dtyp: unknown parameter"):
        parse(ModelsParams, committed("models", **{"kind": "hub", "source": "a", "target": "b", "dtyp": "float32"}),
              "models")
