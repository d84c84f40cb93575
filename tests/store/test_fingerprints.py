"""A model's fingerprint is made of named parts (weights, config, generation config, tokenizer), extra files are no
part of it, a refusal names each part that differs, and a map written before fingerprints had parts still loads
and is compared in its own form."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from helpers.fingerprints import EDITS, edited_copy
from transformers import AutoConfig

from pipeline.kv.mapper import identity_mapper, load_mapper, save_mapper
from pipeline.kv.pair import OtherModelsError, Pair
from pipeline.store.fingerprints import (
    FINGERPRINT_PARTS,
    PairFingerprints,
    fingerprint,
    folder_pin,
    legacy_fingerprint,
    model_differences,
    pair_fingerprints,
)


def map_file(pair: dict[str, Path], path: Path, models: dict) -> Path:
    configs = {side: AutoConfig.from_pretrained(pair[side]) for side in ("source", "target")}
    mapper = identity_mapper("source", "target", configs["source"], configs["target"])
    mapper.models = models
    save_mapper(mapper, path)
    return path


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_each_edit_changes_exactly_its_part_and_extra_files_change_none(edit, tiny_pair, tmp_path):
    folder = tiny_pair["target"]
    before = fingerprint(str(folder))
    assert set(before) == set(FINGERPRINT_PARTS) and all(value.startswith("sha256:") for value in before.values())
    after = fingerprint(edited_copy(folder, tmp_path / "edited", edit))
    changed = sorted(part for part in FINGERPRINT_PARTS if before[part] != after[part])
    assert changed == ([] if EDITS[edit][1] is None else [EDITS[edit][1]])


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_refusal_names_the_part_that_differs_and_a_copy_with_extra_files_accepts_the_map(
        edit, tiny_pair, tmp_path):
    pair = tiny_pair
    path = map_file(pair, tmp_path / "map.safetensors", pair_fingerprints(str(pair["source"]), str(pair["target"])))
    target = edited_copy(pair["target"], tmp_path / "edited", edit)
    loaded = Pair(target, str(pair["source"]), device="cpu")
    if EDITS[edit][1] is None:
        loaded.handoff("mapped", path)
        assert loaded.other_models == []
        return
    said = FINGERPRINT_PARTS[EDITS[edit][1]]
    with pytest.raises(OtherModelsError, match=rf"was fitted on other models: the target's {said} \(fitted on "
                                               rf"sha256:[^;]*\); refit it on these models") as refused:
        loaded.handoff("mapped", path)
    assert "\n" not in str(refused.value)


def test_a_folder_pin_ignores_extra_files_and_follows_every_part(tiny_pair, tmp_path):
    folder = tiny_pair["target"]
    pins = {edit: folder_pin(edited_copy(folder, tmp_path / edit.replace(" ", "_"), edit)) for edit in EDITS}
    unchanged = [edit for edit, (_, part) in EDITS.items() if part is None]
    assert {pins[edit] for edit in unchanged} == {folder_pin(folder)}
    changed = [pins[edit] for edit in EDITS if edit not in unchanged]
    assert len(set(changed) | {folder_pin(folder)}) == len(changed) + 1


PREVIOUS_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tokenizer.model", "spiece.model",
                            "*.tiktoken", "sentencepiece*.model", "tokenizer_config.json", "special_tokens_map.json",
                            "added_tokens.json", "merges.txt")


def previous_fingerprint(folder: Path) -> dict:
    """A local folder's fingerprint as maps recorded it before it had parts, written out here as it was: a digest of
    every file but hidden ones, and one of the tokenizer files."""
    every = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(folder).parts)):
        every.update(f"{path.relative_to(folder).as_posix()}\0".encode() + path.read_bytes())
    tokenizer = hashlib.sha256()
    for path in sorted({path for pattern in PREVIOUS_TOKENIZER_FILES for path in folder.glob(pattern)}):
        tokenizer.update(f"{path.name}\0".encode() + path.read_bytes() + b"\0")
    return {"pin": f"sha256:{every.hexdigest()}", "tokenizer": tokenizer.hexdigest()}


def test_a_map_written_before_fingerprints_had_parts_loads_and_its_own_folder_accepts_it(tiny_pair, tmp_path):
    pair = tiny_pair
    old = {side: previous_fingerprint(pair[side]) for side in ("source", "target")}
    assert old == {side: legacy_fingerprint(str(pair[side])) for side in ("source", "target")}
    path = map_file(pair, tmp_path / "old.safetensors", old)
    assert load_mapper(path).models == old
    same = Pair(str(pair["target"]), str(pair["source"]), device="cpu")
    same.handoff("mapped", path)
    assert same.other_models == []
    swapped = PairFingerprints(str(pair["target"]), str(pair["source"]))
    assert model_differences(old, swapped) == "was fitted on this pair with source and target swapped"


@pytest.mark.parametrize("edit, said", [
    ("extra files", r"the target's weights, config, generation config or extra files differ \([^;]*\); the map "
                    r"records one digest of a folder's every file"),
    ("tokenizer", r"the target's weights, config, generation config or extra files differ \([^;]*\); the target's "
                  r"tokenizer differs \([^;]*\); the map records one digest"),
])
def test_a_map_written_before_fingerprints_had_parts_is_refused_by_another_folder_saying_what_it_can(
        edit, said, tiny_pair, tmp_path):
    pair = tiny_pair
    old = {side: legacy_fingerprint(str(pair[side])) for side in ("source", "target")}
    path = map_file(pair, tmp_path / "old.safetensors", old)
    loaded = Pair(edited_copy(pair["target"], tmp_path / "edited", edit), str(pair["source"]), device="cpu")
    with pytest.raises(OtherModelsError, match=f"was fitted on other models: {said}.*; refit it on these models"):
        loaded.handoff("mapped", path)


def test_a_self_source_is_its_targets_fingerprint_with_weights_and_config_cut(tiny_pair):
    target = str(tiny_pair["target"])
    whole, cut = fingerprint(target), fingerprint("self:1", target=target)
    assert cut == {**whole, "weights": f"self:1:{whole['weights']}", "config": f"self:1:{whole['config']}"}
