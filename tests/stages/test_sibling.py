"""Stage `sibling` on a tiny generated Llama target (no network): a cut keeps what it says (layers, MLP channels,
query heads within their KV groups) and nothing else, the ranking picks the channels and heads that matter,
healing lowers the KL to the target on held-out rows, the width sibling keeps the KV geometry (direct injection is
defined for its pair, not for a depth sibling's), the smol profile's sibling is the stored shape and costs at most
0.40 of the target's prefill, two builds are byte-identical, any other source costs only a marker file, and a bad
shape is one line."""
from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
import torch
import yaml
from dvc.utils.hydra import compose_and_dump
from helpers import ROOT
from helpers.kvworld import VOCAB, word_tokenizer, write_sequences
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline import sibling as stage
from pipeline.check_params import check
from pipeline.fitting.heal import Teacher, TopTeacher, cut_rows, heal, kept_kl, kl_per_position, scored
from pipeline.fitting.importance import importance
from pipeline.fitting.prune import Cut, choose_cut, choose_layers, pruned, sibling_config
from pipeline.kv.contract import pair_contract
from pipeline.kv.kvcache import kv_geometry
from pipeline.schema.sibling import Shape, SiblingParams
from pipeline.store import paths
from pipeline.store.models import ModelsParams
from pipeline.store.params import ParamError, parse
from pipeline.store.shapes import PAIRS, pair_configs

LAYERS, HEADS, KV_HEADS, CHANNELS, HEAD_DIM = 6, 4, 2, 64, 8
SETTINGS = dict(shape="mlp:16+heads:2", keep="influence", ranking_sequences=4, prefill_length=64, steps=40,
                batch_sequences=4, row_length=20, lr=3e-3, warmup_steps=4, weight_decay=0.0, top_k=16,
                max_seconds=600.0, curve_every=20, curve_sequences=4, seed=0, threads=1)


def llama_target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=CHANNELS, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=64, tie_word_embeddings=True,
                         initializer_range=0.2)  # sharp next-token distributions
    return LlamaForCausalLM(config).eval()


def models(source: str) -> ModelsParams:
    return parse(ModelsParams, dict(kind="hub", source=source, target="models/target", source_revision=None,
                                    target_revision=None, dtype="float32", device="cpu", device_map=None), "models")


def sibling_params(**changes) -> SiblingParams:
    return parse(SiblingParams, {**SETTINGS, **changes}, "sibling")


def whole(layers=range(LAYERS), channels=CHANNELS, heads=HEADS) -> Cut:
    """A cut keeping the first `channels` channels and `heads` heads (the first of each group) of `layers`."""
    per_group = heads // KV_HEADS
    kept_heads = [group * (HEADS // KV_HEADS) + index for group in range(KV_HEADS) for index in range(per_group)]
    return Cut(list(layers), [list(range(channels))] * len(layers), [kept_heads] * len(layers))


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


IDS = torch.tensor([[5, 9, 14, 3, 22, 7, 40, 2]])


def test_a_depth_cut_keeps_its_layers_and_every_other_weight_is_the_targets_own():
    target = llama_target()
    sibling = pruned(target, whole([0, 2, 5]))
    assert sibling.config.num_hidden_layers == 3 and target.config.num_hidden_layers == LAYERS
    for new, old in enumerate([0, 2, 5]):
        for (name, tensor), (_, original) in zip(sibling.model.layers[new].state_dict().items(),
                                                 target.model.layers[old].state_dict().items()):
            assert torch.equal(tensor, original), name
        assert sibling.model.layers[new].self_attn.layer_idx == new
    assert torch.equal(sibling.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(sibling.model.norm.weight, target.model.norm.weight)
    assert sibling.lm_head.weight is sibling.model.embed_tokens.weight  # tied as the target's


def test_a_width_cut_keeps_the_chosen_rows_and_columns_and_the_kv_projections_whole():
    target = llama_target()
    cut = Cut(list(range(LAYERS)), [[1, 5, 8, 60]] * LAYERS, [[1, 2]] * LAYERS)  # heads 1 (group 0), 2 (group 1)
    sibling = pruned(target, cut)
    assert (sibling.config.intermediate_size, sibling.config.num_attention_heads) == (4, 2)
    assert kv_geometry(sibling.config) == kv_geometry(target.config)
    ours, theirs = sibling.model.layers[3], target.model.layers[3]
    rows_of = torch.cat([torch.arange(8, 16), torch.arange(16, 24)])  # heads 1 and 2, head_dim 8
    assert torch.equal(ours.self_attn.q_proj.weight, theirs.self_attn.q_proj.weight[rows_of])
    assert torch.equal(ours.self_attn.o_proj.weight, theirs.self_attn.o_proj.weight[:, rows_of])
    assert torch.equal(ours.mlp.up_proj.weight, theirs.mlp.up_proj.weight[[1, 5, 8, 60]])
    assert torch.equal(ours.mlp.down_proj.weight, theirs.mlp.down_proj.weight[:, [1, 5, 8, 60]])
    for name in ("k_proj", "v_proj"):
        assert torch.equal(getattr(ours.self_attn, name).weight, getattr(theirs.self_attn, name).weight)


def test_a_cut_keeping_every_channel_and_head_is_the_target_itself():
    target = llama_target()
    same = pruned(target, whole())
    with torch.no_grad():
        torch.testing.assert_close(same(input_ids=IDS).logits, target(input_ids=IDS).logits, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cut", [whole([0, 3, 5]), whole(channels=16, heads=2), whole([0, 4, 5], 16, 2)],
                         ids=["depth", "width", "both"])
def test_a_pruned_model_decodes_with_a_cache_as_it_scores_the_whole_sequence(cut):
    sibling = pruned(llama_target(), cut)
    with torch.no_grad():
        full = sibling(input_ids=IDS).logits[0, -1]
        prefix = sibling(input_ids=IDS[:, :-1], use_cache=True)
        step = sibling(input_ids=IDS[:, -1:], cache=prefix.cache, use_cache=True).logits[0, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


def test_importance_ranks_the_channels_and_heads_that_reach_the_residual_stream_first():
    """A target whose MLPs only write through channels 3, 17, 40 and 41 and whose attention only through heads 1 and
    2 (one per KV group): ranked on one batch, the cut keeping four channels and one head per group is exactly those,
    and it computes what the target computes."""
    target, useful_channels, useful_heads = llama_target(), [3, 17, 40, 41], [1, 2]
    with torch.no_grad():
        for layer in target.model.layers:
            silent = torch.ones(CHANNELS, dtype=torch.bool)
            silent[useful_channels] = False
            layer.mlp.down_proj.weight[:, silent] = 0.0
            layer.mlp.down_proj.weight[:, 3] *= 0.01  # small but not silent: still above every silent channel
            for head in set(range(HEADS)) - set(useful_heads):
                layer.self_attn.o_proj.weight[:, head * HEAD_DIM : (head + 1) * HEAD_DIM] = 0.0
    ranked = importance(target, [(IDS, torch.ones_like(IDS))])
    cut = choose_cut(ranked, list(range(LAYERS)), 4, 2, KV_HEADS)
    assert cut.channels == [useful_channels] * LAYERS and cut.heads == [useful_heads] * LAYERS
    assert ranked.channels[:, 3].min() > 0 and float(ranked.channels[:, [0, 1, 2]].max()) == 0.0
    with torch.no_grad():
        torch.testing.assert_close(pruned(target, cut)(input_ids=IDS).logits, target(input_ids=IDS).logits,
                                   atol=1e-5, rtol=1e-5)


def test_block_influence_keeps_the_first_and_last_layer_and_the_most_influential_others():
    assert choose_layers([0.9, 0.1, 0.5, 0.2, 0.6, 0.3], 4) == [0, 2, 4, 5]
    target = llama_target()
    with torch.no_grad():  # layer 3 made an identity: its influence is 0
        target.model.layers[3].self_attn.o_proj.weight.zero_()
        target.model.layers[3].mlp.down_proj.weight.zero_()
    influence = importance(target, [(IDS[:, :4], torch.ones(1, 4, dtype=torch.long))]).influence
    assert abs(influence[3]) < 1e-6 and min(influence[:3] + influence[4:]) > 1e-4
    assert 3 not in choose_layers(influence, 5)


def test_the_kept_kl_is_the_full_kl_with_one_token_left_over_and_below_it_with_fewer_kept():
    target, student = llama_target(), pruned(llama_target(), whole(channels=16, heads=2))
    row = [IDS[0].tolist()]
    with torch.no_grad():
        teacher_logits, student_logits = target(input_ids=IDS).logits, student(input_ids=IDS).logits
        full = kl_per_position(teacher_logits, student_logits)  # (1, T)
        every = kept_kl(TopTeacher(target, row, VOCAB - 1, 1).kept([0]), student_logits)  # the rest: one token
        few = kept_kl(TopTeacher(target, row, 4, 1).kept([0]), student_logits)
    torch.testing.assert_close(every, full, atol=1e-5, rtol=1e-4)
    assert bool((few <= full + 1e-6).all()) and bool((few > 0).all())


def test_calibration_windows_are_cut_into_full_rows_in_order_and_a_short_window_stays_whole():
    long, short = list(range(10)), [7, 8]
    assert cut_rows([long, short], 4) == [[0, 1, 2, 3], [4, 5, 6, 7], short]  # the tail 8, 9 is left out
    assert cut_rows([long], 5) == [long[:5], long[5:]] and cut_rows([short], 2) == [short]
    with pytest.raises(ValueError, match="row length 0"):
        cut_rows([long], 0)


def test_healing_lowers_the_kl_to_the_target_on_held_out_rows(project):
    target = llama_target()
    student = pruned(target, choose_cut(importance(target, [(IDS, torch.ones_like(IDS))]), list(range(LAYERS)), 16, 2,
                                        KV_HEADS))
    held_out = Teacher(target, rows(project, paths.split("select")))
    before = scored(student, held_out, list(range(8)), 4)
    settings = sibling_params()
    result = heal(student, TopTeacher(target, rows(project, paths.CALIBRATION_POOL), settings.top_k, 4), held_out,
                  settings, time.perf_counter())
    after = scored(student, held_out, list(range(8)), 4)
    assert result["steps"] == 40 and result["stopped_by"] == "steps"
    assert after["kl"] < 0.85 * before["kl"], (before, after)
    assert [point["step"] for point in result["curve"]] == [0, 20, 40]


def test_the_width_sibling_keeps_the_kv_geometry_so_direct_injection_is_defined_and_a_depth_sibling_not():
    target = llama_target().config
    width = sibling_config(target, list(range(LAYERS)), 16, 2)
    depth = sibling_config(target, [0, 2, 5], CHANNELS, HEADS)
    assert pair_contract(target, width).defined("direct") and pair_contract(target, width).defined("mapped")
    assert not pair_contract(target, depth).defined("direct") and pair_contract(target, depth).defined("mapped")
    assert "equal KV geometry" in pair_contract(target, depth).reason("direct")


def smol_sibling_shape() -> str:
    return yaml.safe_load((ROOT / "conf/profile/smol.yaml").read_text())["sibling"]["shape"]


def test_the_smol_profiles_sibling_is_the_stored_shape_and_costs_at_most_040_of_the_targets_prefill():
    source, target = pair_configs("smol-sibling")
    counts = Shape.parse(smol_sibling_shape()).within(target, "smollm2-135m")
    built = sibling_config(target, list(range(counts.layers)), counts.mlp, counts.heads)
    fields = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "tie_word_embeddings", "max_position_embeddings", "rms_norm_eps")
    assert {name: getattr(built, name) for name in fields} == {name: getattr(source, name) for name in fields}
    assert kv_geometry(source) == kv_geometry(target) and pair_contract(target, source).defined("direct")
    assert 0.30 < stage.prefill_ratio(source, target, 1024) <= 0.40
    assert PAIRS["smol-sibling"] == ("smollm2-135m-sibling", "smollm2-135m")


@pytest.mark.parametrize("shape", ["mlp:320+heads:6", "layers:12", "layers:20+mlp:768+heads:6"])
def test_the_smol_profile_with_the_sibling_as_its_source_passes_check_params_at_each_shape(tmp_path, shape):
    out = tmp_path / "params.yaml"
    compose_and_dump(out, str(ROOT / "conf"), None, "config", "",
                     ["profile=smol", "models.source=models/sibling", f"sibling.shape={shape}"])
    params = yaml.safe_load(out.read_text())
    assert params["sibling"]["shape"] == shape and sorted(check(params)) == sorted(params)


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
        stage.run(sibling_params(), trained, paths.CALIBRATION_POOL, paths.split("select"), paths.SIBLING)
