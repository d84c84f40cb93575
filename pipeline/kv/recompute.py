"""The repair's run: the target recomputes part of a handed-off prefix cache as a `kv.repair.Repair` setting says,
and counts what it computed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeline.kv import projections
from pipeline.kv.kvcache import Layers, additive_mask, cache_to_layers, layers_to_cache, padded_positions, real_slots
from pipeline.kv.repair import Repair
from pipeline.kv.selectors import EXACT, SELECTORS, Evidence
from pipeline.store.lazy import lazy

torch = lazy("torch")
transformers = lazy("transformers")


@dataclass
class RepairCount:
    forwards: int = 0
    token_layers: int = 0  # tokens through a full decoder layer
    recomputed: int = 0  # sink and chosen tokens, over every row
    log: list = field(default_factory=list)  # per call: (recomputed tokens, seconds)
    # the latest call's positions recomputed in every layer, (B, K) ascending, -1 pads; None where none were
    selected: torch.Tensor | None = None


def repair_cache(target, layers: Layers, prefix_ids: torch.Tensor, lengths: torch.Tensor, setting: Repair,
                 count: RepairCount, devices, source_scores: torch.Tensor | None) -> Layers:
    """`layers` (per layer (B, H, P, D), rotated, target dtype) of prefix_ids (B, P) repaired by `setting`."""
    batch, width = prefix_ids.shape
    config = target.config  # `setting` fits it: checked where it entered (check_params, Transfer.check_geometry)
    selector = setting.selector if setting.tokens else None
    mapped, layers = layers, [(k.clone(), v.clone()) for k, v in layers]
    exact_index = max(setting.exact_layers - 1, 0)
    exact = None
    if setting.exact_layers or (selector and EXACT in selector.needs):
        exact = exact_layers(target, prefix_ids, max(setting.exact_layers, 1), count)
        for index in range(setting.exact_layers):
            layers[index] = tuple(t.to(layers[index][0].device, layers[index][0].dtype) for t in exact[index])
    sink = min(setting.sink, width)
    if sink:
        mask = real_slots(lengths, sink).long()  # (B, s)
        out = target.model(input_ids=prefix_ids[:, :sink].to(target.device), attention_mask=mask.to(target.device),
                           use_cache=True).cache
        count.forwards += 1
        count.token_layers += batch * sink * config.num_hidden_layers
        count.recomputed += int(lengths.clamp(max=sink).sum())
        for index, (keys, values) in enumerate(cache_to_layers(out)):
            layers[index][0][:, :, :sink] = keys.to(layers[index][0].device)
            layers[index][1][:, :, :sink] = values.to(layers[index][1].device)
    count.selected = selected_positions(lengths, sink, None) if setting.sink or setting.tokens else None
    chosen_per_row = [setting.chosen(int(n)) for n in lengths] if setting.tokens else [0]
    if max(chosen_per_row) == 0:
        return layers
    evidence = Evidence(target, layers, mapped, None if exact is None else exact[exact_index], exact_index,
                        prefix_ids, lengths, count, devices, source_scores)
    scores = SELECTORS[setting.select_by].score(evidence, setting.argument)  # (B, P)
    chosen = choose(scores, lengths, sink, chosen_per_row)  # (B, M), -1 past a row's count
    count.selected = selected_positions(lengths, sink, chosen)
    return recompute(target, layers, prefix_ids, lengths, chosen, count, devices)


def choose(scores: torch.Tensor, lengths: torch.Tensor, sink: int, counts: list[int]) -> torch.Tensor:
    """(B, M) per row, the positions (ascending, -1 pads) of its `counts[b]` highest scores among sink..lengths[b]-1."""
    batch, width = scores.shape
    slots = torch.arange(width)[None]  # (1, P)
    eligible = (slots >= sink) & (slots < lengths[:, None])  # (B, P)
    ranked = scores.float().cpu().masked_fill(~eligible, -math.inf)
    top = ranked.topk(max(counts), dim=1).indices  # (B, M)
    chosen = torch.full_like(top, -1)
    for row, n in enumerate(counts):
        chosen[row, :n] = top[row, :n].sort().values
    return chosen


def selected_positions(lengths: torch.Tensor, sink: int, chosen: torch.Tensor | None) -> torch.Tensor:
    """(B, K) the positions recomputed in every layer, ascending, -1 pads: each row's sink and `chosen` (B, M)."""
    rows = [torch.arange(min(sink, int(length))) for length in lengths]
    if chosen is not None:
        rows = [torch.cat([row, picked[picked >= 0]]) for row, picked in zip(rows, chosen)]
    return padded_positions(rows)


def exact_layers(target, prefix_ids: torch.Tensor, n: int, count: RepairCount) -> Layers:
    """The target's own keys/values (B, H, P, D), rotated, of its first n layers: 0..n-2 in full, layer n-1's input
    norm and K/V projections only."""
    decoder = target.model
    batch, width = prefix_ids.shape
    hidden = decoder.embed_tokens(prefix_ids.to(target.device))  # (B, P, hidden)
    positions = torch.arange(width, device=target.device)[None].expand(batch, -1)  # (B, P)
    cos, sin = decoder.rotary_emb(hidden, positions)  # (B, P, D) each
    cache = transformers.DynamicCache(config=target.config)
    causal = torch.ones(width, width, dtype=torch.bool).tril()  # right padding never reaches a real token
    mask = additive_mask(causal, hidden.dtype)[None, None].expand(batch, 1, -1, -1).to(target.device)  # (B, 1, P, P)
    for layer in decoder.layers[: n - 1]:
        hidden = layer(hidden, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                       position_embeddings=(cos, sin))
    count.forwards += 1
    count.token_layers += batch * width * (n - 1)
    attention = decoder.layers[n - 1].self_attn
    normed = projections.layer_input(decoder.layers[n - 1], hidden)  # (B, P, hidden)
    keys = projections.rotate(projections.keys(attention, normed), cos, sin)  # (B, H, P, D)
    return cache_to_layers(cache)[: n - 1] + [(keys, projections.values(attention, normed))]


def recompute(target, layers: Layers, prefix_ids: torch.Tensor, lengths: torch.Tensor, chosen: torch.Tensor,
              count: RepairCount, devices) -> Layers:
    """`layers` with the tokens at `chosen` (B, M; -1 pads) recomputed by the target's decoder in one forward:
    token i at its position p_i sees the slots before p_i that are not chosen and the chosen tokens at p <= p_i.

        cache slots 0 .. P-1 (mapped/repaired)    | fresh slots P .. P+M-1 (the chosen, in order)
        j < p_i and j not chosen                  | p_k <= p_i (itself included)
    """
    batch, width = prefix_ids.shape
    valid = chosen >= 0  # (B, M)
    positions = chosen.clamp(min=0)  # (B, M)
    tokens = prefix_ids.cpu().gather(1, positions)  # (B, M)
    is_chosen = torch.zeros(batch, width, dtype=torch.bool)
    is_chosen[valid.nonzero()[:, 0], chosen[valid]] = True  # (B, P)
    slots = torch.arange(width)
    old = (slots[None, None] < positions[:, :, None]) & ~is_chosen[:, None]  # (B, M, P)
    fresh = (positions[:, None, :] <= positions[:, :, None]) & valid[:, None, :]  # (B, M, M)
    fresh |= torch.eye(chosen.shape[1], dtype=torch.bool)[None] & ~valid[:, :, None]  # a pad sees itself
    allowed = torch.cat([old & valid[:, :, None], fresh], dim=2)[:, None]  # (B, 1, M, P + M)
    dtype = target.dtype
    mask = additive_mask(allowed, dtype)
    cache = layers_to_cache(layers, target.config, dtype, devices or target.device)
    out = target.model(input_ids=tokens.to(target.device), cache=cache, use_cache=True,
                       attention_mask=mask.to(target.device), position_ids=positions.to(target.device)).cache
    count.forwards += 1
    count.token_layers += chosen.numel() * target.config.num_hidden_layers
    count.recomputed += int(valid.sum())
    rows, columns = valid.nonzero(as_tuple=True)
    repaired = []
    for (keys, values), layer in zip(layers, cache_to_layers(out)):
        new_keys, new_values = layer[0][:, :, width:], layer[1][:, :, width:]  # (B, H, M, D)
        keys, values = keys.clone(), values.clone()
        target_slots = chosen[rows, columns]
        keys[rows, :, target_slots] = new_keys[rows, :, columns].to(keys.device, keys.dtype)
        values[rows, :, target_slots] = new_values[rows, :, columns].to(values.device, values.dtype)
        repaired.append((keys, values))
    return repaired
