"""What each part of the target does (`fitting.importance`): the channels and heads that reach the residual
stream rank first, and block influence keeps the first and last layer and the most influential others."""
from __future__ import annotations

import torch
from helpers.sibling import CHANNELS, HEAD_DIM, HEADS, IDS, KV_HEADS, LAYERS, llama_target

from pipeline.fitting.importance import importance
from pipeline.fitting.prune import choose_cut, choose_layers, pruned


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
