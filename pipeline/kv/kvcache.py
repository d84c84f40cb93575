"""Caches as tensors and back, the keys a model computes before RoPE, and a batch of contexts' prefixes, right-padded.
Layout everywhere: a list over layers of (keys, values), each (batch, kv_heads, tokens, head_dim).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from pipeline.kv import projections
from pipeline.kv.geometry import kv_geometry
from pipeline.store.lazy import lazy

torch = lazy("torch")
transformers = lazy("transformers")

Layers = list[tuple["torch.Tensor", "torch.Tensor"]]


def real_slots(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) bool: slot j < lengths[b], the real slots of right-padded rows."""
    return torch.arange(width)[None] < lengths.cpu()[:, None]


def padded_positions(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rows of positions (each (K_b,), ascending) as one (B, K) long tensor, K the longest row, -1 after each row's."""
    out = torch.full((len(rows), max((len(row) for row in rows), default=0)), -1, dtype=torch.long)
    for index, row in enumerate(rows):
        out[index, : len(row)] = row
    return out


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: may attend) as an additive mask: 0 or the dtype's minimum."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)


def segment_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, L, L) bool: each token of a packed row sees itself and the earlier tokens of its own segment (`segments`
    (B, L), -1 on padding: padding sees padding only)."""
    steps = segments.shape[1]
    return (segments[:, :, None] == segments[:, None, :]) & torch.ones(steps, steps, dtype=torch.bool).tril()


class Prefixes(NamedTuple):
    """A batch of contexts c[0..n-1]: each prefix c[0..n-2] right-padded, and c[n-1].

        ids     c0[0] ... c0[n0-2] pad pad      (B, P)       last  c0[n0-1]   (B, 1)
                c1[0] ... ......... c1[n1-2]                        c1[n1-1]
    """

    ids: torch.Tensor  # (B, P) long
    lengths: torch.Tensor  # (B,) each prefix's real length n - 1
    mask: torch.Tensor  # (B, P) long: 1 at the real slots
    last: torch.Tensor  # (B, 1) long: each context's last token c[n-1]

    @classmethod
    def of(cls, contexts: torch.Tensor) -> Prefixes:
        """The prefixes of contexts (B, n) of one length."""
        ids = contexts[:, :-1]
        lengths = torch.full((len(contexts),), ids.shape[1])
        return cls(ids, lengths, real_slots(lengths, ids.shape[1]).long(), contexts[:, -1:])

    @property
    def padded(self) -> bool:
        """Whether any row is shorter than the batch's width (a full batch is read without a mask)."""
        return bool((self.lengths != self.ids.shape[1]).any())

    @property
    def padded_lengths(self) -> torch.Tensor | None:
        return self.lengths if self.padded else None

    @property
    def attention_mask(self) -> torch.Tensor | None:
        return self.mask if self.padded else None


def padded_prefixes(contexts: Sequence[Sequence[int]]) -> Prefixes:
    lengths = torch.tensor([len(context) - 1 for context in contexts])
    ids = torch.zeros(len(contexts), int(lengths.max()), dtype=torch.long)
    for row, context in enumerate(contexts):
        ids[row, : len(context) - 1] = torch.tensor(list(context[:-1]), dtype=torch.long)
    last = torch.tensor([[context[-1]] for context in contexts], dtype=torch.long)
    return Prefixes(ids, lengths, real_slots(lengths, ids.shape[1]).long(), last)


def cache_to_layers(cache) -> Layers:
    return [(layer.keys, layer.values) for layer in cache.layers]


def layer_devices(model) -> list[torch.device] | None:
    """Where each decoder layer of `model` lives, for a model spread over several devices; None for one device."""
    devices = [next(layer.parameters()).device for layer in model.model.layers]
    return devices if len(set(devices)) > 1 else None


def layers_to_cache(layers: Layers, config, dtype: torch.dtype, device) -> transformers.DynamicCache:
    """A DynamicCache of `layers` cast to `dtype`, on `device` or, given a list, each layer on its own."""
    if len(layers) != config.num_hidden_layers:
        raise ValueError(f"{len(layers)} cache layers for a model of {config.num_hidden_layers} layers")
    expected = (config.num_key_value_heads, kv_geometry(config)["head_dim"])
    for index, (keys, values) in enumerate(layers):
        if (keys.shape[1], keys.shape[3]) != expected or keys.shape != values.shape:
            raise ValueError(
                f"cache layer {index}: keys {tuple(keys.shape)}, values {tuple(values.shape)} do not fit "
                f"(batch, {expected[0]} kv heads, tokens, head_dim {expected[1]})"
            )
    devices = device if isinstance(device, list) else [device] * len(layers)
    cast = [(k.to(device=d, dtype=dtype), v.to(device=d, dtype=dtype)) for (k, v), d in zip(layers, devices)]
    return transformers.DynamicCache(cast, config=config)


def pre_rope_keys(model, token_ids: list[int]) -> tuple[list[torch.Tensor], Layers]:
    """Per layer, the keys (1, kv_heads, T, head_dim) `model` computes on token_ids before RoPE, and its cache."""
    with torch.no_grad(), projections.attention_inputs(model) as captured:
        cache = model.model(input_ids=torch.tensor([list(token_ids)]).to(model.device), use_cache=True).cache
        keys = [projections.keys(module, hidden) for module, hidden, _ in captured.values()]  # (B, H, T, D) each
    return keys, cache_to_layers(cache)
