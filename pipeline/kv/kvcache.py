"""Per-layer keys/values out of a transformers cache, a transformers cache built from tensors, and the keys a
model computes before its rotary embedding (what a stripped cache must equal: the RoPE control's reference).

Layout everywhere: a list over layers of (keys, values), each (batch, kv_heads, tokens, head_dim).
"""
from __future__ import annotations

from pipeline.kv import projections
from pipeline.store.lazy import lazy

torch = lazy("torch")
transformers = lazy("transformers")

Layers = list[tuple["torch.Tensor", "torch.Tensor"]]


def cache_to_layers(cache) -> Layers:
    return [(layer.keys, layer.values) for layer in cache.layers]


def layer_devices(model) -> list[torch.device] | None:
    """Where each decoder layer of `model` lives, for a model that accelerate spread over several devices
    (`from_pretrained(device_map=...)`); None for a model on one device."""
    devices = [next(layer.parameters()).device for layer in model.model.layers]
    return devices if len(set(devices)) > 1 else None


def layers_to_cache(layers: Layers, config, dtype: torch.dtype, device) -> transformers.DynamicCache:
    """A fresh DynamicCache for the model of `config`, holding `layers` cast to its dtype and on `device`, or
    with a list of devices (`layer_devices`) each layer on its own: the cache moves, the model stays."""
    if len(layers) != config.num_hidden_layers:
        raise ValueError(f"{len(layers)} cache layers for a model of {config.num_hidden_layers} layers")
    expected = (config.num_key_value_heads,
                getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    for index, (keys, values) in enumerate(layers):
        if (keys.shape[1], keys.shape[3]) != expected or keys.shape != values.shape:
            raise ValueError(
                f"cache layer {index}: keys {tuple(keys.shape)}, values {tuple(values.shape)} do not fit "
                f"(batch, {expected[0]} kv heads, tokens, head_dim {expected[1]})"
            )
    devices = device if isinstance(device, list) else [device] * len(layers)
    cast = [(k.to(device=d, dtype=dtype), v.to(device=d, dtype=dtype)) for (k, v), d in zip(layers, devices)]
    return transformers.DynamicCache(cast, config=config)


def expand_batch(layers: Layers, batch: int) -> Layers:
    """Repeat a batch-1 cache `batch` times (requests sharing one context share one prefill)."""
    return [(k.expand(batch, -1, -1, -1).contiguous(), v.expand(batch, -1, -1, -1).contiguous()) for k, v in layers]


def kv_geometry(config) -> dict:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"layers": config.num_hidden_layers, "kv_heads": config.num_key_value_heads, "head_dim": head_dim}


def pre_rope_keys(model, token_ids: list[int]) -> tuple[list[torch.Tensor], Layers]:
    """Run `model` on token_ids; per layer, the keys (1, kv_heads, T, head_dim) its attention computed just before
    the rotary embedding (`kv.projections.keys` of the states the attention read), and its cache."""
    captured: dict[int, torch.Tensor] = {}

    def keep(index):
        def hook(module, args, kwargs, output):
            captured[index] = projections.keys(module, kwargs["hidden_states"] if "hidden_states" in kwargs
                                               else args[0])  # (B, H, T, D)
        return hook

    hooks = [layer.self_attn.register_forward_hook(keep(index), with_kwargs=True)
             for index, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            cache = model.model(input_ids=torch.tensor([list(token_ids)]).to(model.device), use_cache=True).cache
    finally:
        for hook in hooks:
            hook.remove()
    return [captured[index] for index in range(len(hooks))], cache_to_layers(cache)
