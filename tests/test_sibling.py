"""Stage `sibling` on a tiny generated Llama target (no network): the kept layers are the target's own, healing lowers
the KL to the target on held-out rows, two builds are byte-identical, any other source costs only a marker file, and
a bad layer list is one line."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from kvworld import VOCAB, word_tokenizer, write_sequences
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline import sibling as stage
from pipeline.fitting.heal import Healing, Teacher, heal, scored
from pipeline.fitting.prune import block_influence, choose_layers, pruned
from pipeline.schema.sibling import SiblingParams
from pipeline.store import paths
from pipeline.store.models import ModelsParams
from pipeline.store.params import ParamError, parse

LAYERS = 6
SETTINGS = dict(layers=3, keep="influence", influence_sequences=4, steps=40, batch_sequences=4, lr=3e-3,
                warmup_steps=4, weight_decay=0.0, max_seconds=600.0, curve_every=20, curve_sequences=4, seed=0,
                threads=1)


def llama_target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         tie_word_embeddings=True, initializer_range=0.2)  # sharp next-token distributions
    return LlamaForCausalLM(config).eval()


def models(source: str) -> ModelsParams:
    return parse(ModelsParams, dict(kind="hub", source=source, target="models/target", source_revision=None,
                                    target_revision=None, dtype="float32", device="cpu", device_map=None), "models")


def sibling_params(**changes) -> SiblingParams:
    return parse(SiblingParams, {**SETTINGS, **changes}, "sibling")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sibling")
    llama_target().save_pretrained(root / "models" / "target")
    word_tokenizer().save_pretrained(root / "models" / "target")
    write_sequences(root / paths.CALIBRATION_POOL, 24, 20, 0, "fit")
    write_sequences(root / paths.split("select"), 8, 20, 1, "select")
    return root


def rows(project: Path, split: Path) -> list[list[int]]:
    return stage.sequences(project / split)


def test_the_kept_layers_and_every_other_weight_are_the_targets_own():
    target = llama_target()
    sibling = pruned(target, [0, 2, 5])
    assert sibling.config.num_hidden_layers == 3 and target.config.num_hidden_layers == LAYERS
    for new, old in enumerate([0, 2, 5]):
        for (name, tensor), (_, original) in zip(sibling.model.layers[new].state_dict().items(),
                                                 target.model.layers[old].state_dict().items()):
            assert torch.equal(tensor, original), name
        assert sibling.model.layers[new].self_attn.layer_idx == new
    assert torch.equal(sibling.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(sibling.model.norm.weight, target.model.norm.weight)
    assert sibling.lm_head.weight is sibling.model.embed_tokens.weight  # tied as the target's


def test_a_pruned_model_decodes_with_a_cache_as_it_scores_the_whole_sequence():
    sibling = pruned(llama_target(), [0, 3, 5])
    ids = torch.tensor([[5, 9, 14, 3, 22, 7]])
    whole = sibling(input_ids=ids).logits[0, -1]
    prefix = sibling(input_ids=ids[:, :-1], use_cache=True)
    step = sibling(input_ids=ids[:, -1:], cache=prefix.cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(step, whole, atol=1e-5, rtol=1e-5)


def test_block_influence_keeps_the_first_and_last_layer_and_the_most_influential_others():
    assert choose_layers([0.9, 0.1, 0.5, 0.2, 0.6, 0.3], 4) == [0, 2, 4, 5]
    target = llama_target()
    with torch.no_grad():  # layer 3 made an identity: its influence is 0
        target.model.layers[3].self_attn.o_proj.weight.zero_()
        target.model.layers[3].mlp.down_proj.weight.zero_()
    influence = block_influence(target, [(torch.tensor([[1, 2, 3, 4]]), torch.ones(1, 4, dtype=torch.long))])
    assert abs(influence[3]) < 1e-6 and min(influence[:3] + influence[4:]) > 1e-4
    assert 3 not in choose_layers(influence, 5)


def test_healing_lowers_the_kl_to_the_target_on_held_out_rows(project):
    target = llama_target()
    student = pruned(target, [0, 2, 5])
    held_out = Teacher(target, rows(project, paths.split("select")))
    before = scored(student, held_out, list(range(8)), 4)
    settings = Healing(**{key: value for key, value in SETTINGS.items() if key in Healing.__dataclass_fields__})
    result = heal(student, Teacher(target, rows(project, paths.CALIBRATION_POOL)), held_out, settings,
                  time.perf_counter())
    after = scored(student, held_out, list(range(8)), 4)
    assert result["steps"] == 40 and result["stopped_by"] == "steps"
    assert after["kl"] < 0.85 * before["kl"], (before, after)
    assert [point["step"] for point in result["curve"]] == [0, 20, 40]


def build(project: Path, source: str, monkeypatch, **changes) -> dict:
    monkeypatch.chdir(project)
    return stage.run(sibling_params(**changes), models(source), paths.CALIBRATION_POOL, paths.split("select"),
                     paths.SIBLING)


def files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_two_builds_give_byte_identical_folders_a_loadable_checkpoint_and_its_figures(project, monkeypatch):
    first = build(project, "models/sibling", monkeypatch, steps=6)
    kept = files(project / paths.SIBLING)
    second = build(project, "models/sibling", monkeypatch, steps=6)
    assert files(project / paths.SIBLING) == kept
    assert {key: value for key, value in first.items() if key != "seconds" and key != "curve"} == \
        {key: value for key, value in second.items() if key != "seconds" and key != "curve"}
    assert (kept["tokenizer.json"] == (project / "models/target/tokenizer.json").read_bytes())
    reloaded = LlamaForCausalLM.from_pretrained(project / paths.SIBLING)
    assert reloaded.config.num_hidden_layers == 3 and len(first["layers"]) == 3 and first["steps"] == 6
    assert 0 < first["prefill_cost_ratio"] < 0.5
    assert json.loads(kept[stage.PROVENANCE])["layers"] == first["layers"]


def test_any_other_source_gets_the_marker_alone_and_loads_nothing(project, monkeypatch):
    monkeypatch.setattr(stage, "load_model", None)  # a call would raise
    result = build(project, "self:2", monkeypatch)
    assert result == {"built": False, "source": "self:2"}
    assert files(project / paths.SIBLING) == {stage.PROVENANCE: b'{"built": false}\n'}


@pytest.mark.parametrize("keep, message", [
    ([0, 2, 9], r"^sibling\.keep: \[0, 2, 9\] names a layer outside the target's 6 decoder layers"),
    ([0, 1, 2, 3, 4, 5], r"^sibling\.layers: 6 of the target's 6 decoder layers"),
])
def test_a_layer_list_the_target_does_not_have_is_refused_in_one_line(project, monkeypatch, keep, message):
    with pytest.raises(ParamError, match=message) as refusal:
        build(project, "models/sibling", monkeypatch, keep=keep, layers=len(keep))
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize("changes, message", [
    (dict(keep=[0, 3]), r"^sibling\.keep: 2 layers listed but sibling\.layers is 3"),
    (dict(keep=[0, 3, 3]), r"^sibling\.keep: \[0, 3, 3\] is not strictly ascending"),
    (dict(keep="first"), r"^sibling\.keep"),
    (dict(layers=1), r"^sibling\.layers"),
])
def test_a_malformed_layer_list_is_refused_by_the_params_in_one_line(changes, message):
    with pytest.raises(ParamError, match=message) as refusal:
        sibling_params(**changes)
    assert "\n" not in str(refusal.value)


def test_the_stage_refuses_a_sibling_of_a_model_that_is_not_a_checkpoint(project, monkeypatch):
    monkeypatch.chdir(project)
    trained = models("models/sibling").model_copy(update={"kind": "trained"})
    with pytest.raises(ParamError, match=r"^models\.source: models/sibling is the sibling.*models\.kind is 'trained'"):
        stage.run(sibling_params(), trained, paths.CALIBRATION_POOL, paths.split("select"), paths.SIBLING)

