"""A smaller sibling cut from the target: which decoder layers, MLP channels and query heads it keeps, and the pruned
model itself.

In depth, the layers are declared or chosen by block influence (`fitting.importance`); the first and the last
layer are always kept (the embedding's and the LM head's neighbours, which every depth-pruning study finds least
redundant). In width, each kept layer keeps its MLP channels of highest importance and, within each KV group, its
query heads of highest importance, so every group keeps the same number of query heads and shares its KV head as
before: the KV projections, and so the cache's geometry, are the target's own. The residual width, the embedding,
the norms and the LM head are untouched. Heads of one group (the target's query heads h with h // (H / H_kv) = g)
stay contiguous and in order:

    target heads   [g0: 0 1 2 | g1: 3 4 5 | g2: 6 7 8]     keep 2 per group by importance
    sibling heads  [g0: 0 2   | g1: 3 4   | g2: 7 8  ]  -> 0 1 | 2 3 | 4 5

The pruned model is a fresh model of the target's class whose config has the kept counts; its layer j holds the
target's layer keep[j] with the kept rows of q_proj, gate_proj and up_proj and the kept columns of o_proj and
down_proj; its attention layers are numbered 0..n-1, so its cache is an ordinary n-layer cache.
"""
from __future__ import annotations

import copy
from typing import NamedTuple

from pipeline.fitting.importance import Importance
from pipeline.kv.geometry import kv_geometry
from pipeline.store.lazy import lazy
from pipeline.store.params import ParamError

torch = lazy("torch")

# a layer's tensors whose rows (0) or columns (1) are query heads or MLP channels; every other tensor is copied whole
BY_HEAD = {"self_attn.q_proj.weight": 0, "self_attn.q_proj.bias": 0, "self_attn.o_proj.weight": 1}
BY_CHANNEL = {"mlp.gate_proj.weight": 0, "mlp.gate_proj.bias": 0, "mlp.up_proj.weight": 0, "mlp.up_proj.bias": 0,
              "mlp.down_proj.weight": 1}


class Cut(NamedTuple):
    """What a sibling keeps of the target: target layer indices, and per kept layer its channels and heads."""

    layers: list[int]
    channels: list[list[int]]  # per kept layer, ascending target channel indices
    heads: list[list[int]]  # per kept layer, ascending target query head indices


def choose_layers(influence: list[float], count: int) -> list[int]:
    """The first and the last layer and the `count` - 2 others of highest influence (ties: the lower index)."""
    last = len(influence) - 1
    if not 2 <= count <= last:
        raise ParamError(f"sibling.shape: layers:{count} of the target's {last + 1} decoder layers; a sibling keeps "
                         f"2..{last}")
    middle = sorted(range(1, last), key=lambda index: (-influence[index], index))[: count - 2]
    return sorted({0, last, *middle})


def top(scores, count: int) -> list[int]:
    """The indices of the `count` highest of `scores` (1-D; ties: the lower index), ascending."""
    order = sorted(range(len(scores)), key=lambda index: (-float(scores[index]), index))
    return sorted(order[:count])


def kept_heads(scores, kv_heads: int, per_group: int) -> list[int]:
    """Per KV group (`kv_heads` groups of consecutive query heads), its `per_group` heads of highest `scores`."""
    size = len(scores) // kv_heads
    return [group * size + index for group in range(kv_heads)
            for index in top(scores[group * size : (group + 1) * size], per_group)]


def choose_cut(ranked: Importance, layers: list[int], channels: int, heads: int, kv_heads: int) -> Cut:
    """The cut keeping `layers`, and in each of them its `channels` MLP channels and `heads` query heads (heads /
    kv_heads per group) of highest importance."""
    return Cut(list(layers), [top(ranked.channels[index], channels) for index in layers],
               [kept_heads(ranked.heads[index], kv_heads, heads // kv_heads) for index in layers])


def sibling_config(target_config, layers: list[int], channels: int, heads: int):
    """The target's config with the kept counts (head_dim written out: it is no longer hidden / heads)."""
    config = copy.deepcopy(target_config)
    config.head_dim = kv_geometry(target_config)["head_dim"]
    config.num_hidden_layers, config.intermediate_size, config.num_attention_heads = len(layers), channels, heads
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[index] for index in layers]
    return config


def _kept(tensor, dim: int, units: list[int], size: int):
    """The rows (dim 0) or columns (dim 1) of `tensor` of the kept `units`, each a block of `size`."""
    index = torch.tensor([unit * size + offset for unit in units for offset in range(size)])
    return tensor.index_select(dim, index).detach().clone()


def pruned(target, cut: Cut):
    """A model of the target's class holding what `cut` keeps; every other weight (embedding, norms, LM head,
    K/V projections) copied. The target is left as it was."""
    head_dim = kv_geometry(target.config)["head_dim"]
    config = sibling_config(target.config, cut.layers, len(cut.channels[0]), len(cut.heads[0]))
    sibling = type(target)(config)
    prefix = f"{target.base_model_prefix}.layers."
    position = {index: new for new, index in enumerate(cut.layers)}
    state = {}
    for name, tensor in target.state_dict().items():
        if not name.startswith(prefix):
            state[name] = tensor.detach().clone()
            continue
        index, rest = name[len(prefix):].split(".", 1)
        if int(index) not in position:
            continue
        new = position[int(index)]
        if rest in BY_HEAD:
            tensor = _kept(tensor, BY_HEAD[rest], cut.heads[new], head_dim)
        elif rest in BY_CHANNEL:
            tensor = _kept(tensor, BY_CHANNEL[rest], cut.channels[new], 1)
        state[f"{prefix}{new}.{rest}"] = tensor.detach().clone()
    sibling.load_state_dict(state, strict=True)
    sibling.generation_config = copy.deepcopy(target.generation_config)
    return sibling.to(dtype=target.dtype).eval()
