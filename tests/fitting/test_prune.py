"""A sibling cut from the target (`fitting.prune`): a depth or width cut keeps what it says and nothing else, a
cut keeping everything is the target, a pruned model decodes with a cache as it scores the whole sequence, and the
width sibling keeps the KV geometry (direct injection is defined for its pair, not for a depth sibling's)."""
from __future__ import annotations

import pytest
import torch
from helpers.sibling import CHANNELS, HEADS, IDS, LAYERS, llama_target, whole

from pipeline.fitting.prune import Cut, pruned, sibling_config
from pipeline.kv.contract import pair_contract
from pipeline.kv.geometry import kv_geometry


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


def test_the_width_sibling_keeps_the_kv_geometry_so_direct_injection_is_defined_and_a_depth_sibling_not():
    target = llama_target().config
    width = sibling_config(target, list(range(LAYERS)), 16, 2)
    depth = sibling_config(target, [0, 2, 5], CHANNELS, HEADS)
    assert pair_contract(target, width).defined("direct") and pair_contract(target, width).defined("mapped")
    assert not pair_contract(target, depth).defined("direct") and pair_contract(target, depth).defined("mapped")
    assert "equal KV geometry" in pair_contract(target, depth).reason("direct")
