"""Stage pin_models: the V0 pair fails clearly without the hub; a local checkpoint is pinned by its path and
content (relatively inside the working directory, not without complete weights), a cached hub id offline."""
import json
import shutil

import pytest
from helpers import ROOT, committed
from huggingface_hub import constants as hf_constants

from pipeline import pin_models
from pipeline.store.models import ModelFolderError, ModelNotAvailableError, ModelsParams, load_config
from pipeline.store.params import parse


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
