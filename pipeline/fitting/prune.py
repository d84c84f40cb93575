"""A smaller sibling cut from the target in depth: which decoder layers it keeps and the pruned model itself.

The layers are declared, or chosen by block influence on the healing rows (ShortGPT, arXiv 2403.03853): a layer
whose output hidden state points where its input did (1 - cosine near 0) turns the residual stream least and is
the cheapest to drop. The first and the last layer are always kept (the embedding's and the LM head's neighbours,
which every depth-pruning study finds least redundant). The pruned model is a fresh model of the target's class and
config with n layers, its layer j an exact copy of the target's layer keep[j], the embedding, final norm and LM
head copied; its attention layers are numbered 0..n-1, so its cache is an ordinary n-layer cache.
"""
from __future__ import annotations

import copy

from pipeline.store.devices import no_grad
from pipeline.store.lazy import lazy
from pipeline.store.params import ParamError

torch = lazy("torch")


def check_layers(keep: list[int], total: int, target: str) -> list[int]:
    """`keep` when it names fewer than all of the target's `total` layers, each once, ascending; else the refusal."""
    if any(not 0 <= index < total for index in keep):
        raise ParamError(f"sibling.keep: {keep} names a layer outside the target's {total} decoder layers ({target}); "
                         f"give indices 0..{total - 1}")
    if not 2 <= len(keep) < total:
        raise ParamError(f"sibling.layers: {len(keep)} of the target's {total} decoder layers ({target}); a sibling "
                         f"keeps 2..{total - 1}")
    return list(keep)


def _layer_input(args: tuple, kwargs: dict):
    return args[0] if args else kwargs["hidden_states"]


def _layer_output(output):
    return output[0] if isinstance(output, tuple) else output


@no_grad
def block_influence(model, batches) -> list[float]:
    """Per decoder layer, 1 - the mean cosine between its input and output hidden states over every real token of
    `batches` ((input_ids, attention_mask) pairs)."""
    layers = getattr(model, model.base_model_prefix).layers
    sums, counts = [0.0] * len(layers), [0] * len(layers)
    mask_of_batch = {}

    def hook(index):
        def record(module, args, kwargs, output):
            before, after = _layer_input(args, kwargs), _layer_output(output)  # (B, T, hidden) each
            cosine = torch.nn.functional.cosine_similarity(before.float(), after.float(), dim=-1)  # (B, T)
            mask = mask_of_batch["mask"]
            sums[index] += float((cosine * mask).sum())
            counts[index] += int(mask.sum())
        return record

    handles = [layer.register_forward_hook(hook(index), with_kwargs=True) for index, layer in enumerate(layers)]
    try:
        for input_ids, attention_mask in batches:
            mask_of_batch["mask"] = attention_mask.float()
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [1.0 - total / count for total, count in zip(sums, counts)]


def choose_layers(influence: list[float], count: int) -> list[int]:
    """The first and the last layer and the `count` - 2 others of highest influence (ties: the lower index)."""
    last = len(influence) - 1
    if not 2 <= count <= last:
        raise ParamError(f"sibling.layers: {count} of the target's {last + 1} decoder layers; a sibling keeps "
                         f"2..{last}")
    middle = sorted(range(1, last), key=lambda index: (-influence[index], index))[: count - 2]
    return sorted({0, last, *middle})


def pruned(target, keep: list[int]):
    """A model of the target's class and config with len(keep) decoder layers, layer j a copy of the target's layer
    keep[j]; every other weight (embedding, final norm, LM head) copied. The target is left as it was."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[index] for index in keep]
    sibling = type(target)(config)
    prefix = f"{target.base_model_prefix}.layers."
    position = {index: new for new, index in enumerate(keep)}
    state = {}
    for name, tensor in target.state_dict().items():
        if not name.startswith(prefix):
            state[name] = tensor.detach().clone()
            continue
        index, rest = name[len(prefix):].split(".", 1)
        if int(index) in position:
            state[f"{prefix}{position[int(index)]}.{rest}"] = tensor.detach().clone()
    sibling.load_state_dict(state, strict=True)
    return sibling.to(dtype=target.dtype).eval()
