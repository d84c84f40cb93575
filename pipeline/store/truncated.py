"""The target's own first n decoder layers as the source (`models.source: self:<n>`), the "no second model" baseline:
the target cut to n layers, sharing its weights (never copied; tied embeddings stay tied) and tokenizer. Each decoder
layer reads only the layers below it, so its cache is the target's own there: the maps predict the deeper layers.
"""
from __future__ import annotations

import copy

from pipeline.store.params import ParamError

SELF = "self:"  # models.source `self:<n>`: the target's own first n decoder layers
SELF_POINTER = "self.json"  # a prepared self source: {"layers": n, "target": the prepared target, relative}


def self_layers(name: str | None) -> int | None:
    """n of a `self:<n>` source name, None for any other name; a malformed one is refused naming the key."""
    if name is None or not str(name).startswith(SELF):
        return None
    text = str(name)[len(SELF):]
    if not text.isdigit() or int(text) < 1:
        raise ParamError(f"models.source: {name!r} is not self:<n> (the target's first n decoder layers, n >= 1); "
                         f"write e.g. self:2")
    return int(text)


def self_name(layers: int) -> str:
    return f"{SELF}{layers}"


def truncated_config(config, layers: int):
    """`config` cut to its first `layers` decoder layers, fewer than the target's (the whole target is the oracle)."""
    total = config.num_hidden_layers
    if not 1 <= layers < total:
        raise ParamError(f"models.source: self:{layers} asks for {layers} of the target's {total} decoder layers; "
                         f"use self:<n> with 1 <= n <= {total - 1}")
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types)[:layers]
    config._name_or_path = self_name(layers)
    return config


def _shallow(module):
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


def truncate(model, layers: int):
    """`model` cut to its first `layers` decoder layers, sharing every weight (ties kept)."""
    config = truncated_config(model.config, layers)
    inner = _shallow(getattr(model, model.base_model_prefix))  # the decoder body (`model.model`)
    inner.layers = type(inner.layers)(list(inner.layers)[:layers])
    inner.config = config
    source = _shallow(model)
    setattr(source, model.base_model_prefix, inner)
    source.config = config
    return source.eval()
