"""The source's look-ahead scores (SpecPrefill's token importance, arXiv 2502.02789), read in the forward that
prefills its cache, and the positions speculative prefill keeps by them. Padded slots score 0 and are never kept.

    prefix    c[0] ... c[P-m-1] | c[P-m] ... c[P-1]        one row, right-padded to the batch's width
    queries                       the last m, rotated as the layer rotates them
    keys      every slot, causal: query c[q] reads c[0..q]
    score     softmax per query, pooled (max or mean) over the layers read, the query heads and the m queries
"""
from __future__ import annotations

from typing import Callable

from pipeline.kv import projections
from pipeline.kv.kvcache import Layers, cache_to_layers, padded_positions, real_slots
from pipeline.kv.speculative import SpeculativeParams, chosen
from pipeline.store.lazy import lazy

torch = lazy("torch")


def scored_prefill(model, prefix_ids: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor | None,
                   settings: SpeculativeParams, clock: Callable[[str], None] | None = None
                   ) -> tuple[Layers, torch.Tensor]:
    """`model`'s cache of prefix_ids (B, P) and each slot's look-ahead score (B, P), float32 on the CPU."""
    read = settings.layer_indices(model.config.num_hidden_layers)
    device = model.device
    with projections.attention_inputs(model, read) as captured:
        cache = cache_to_layers(model.model(input_ids=prefix_ids.to(device),
                                            attention_mask=None if mask is None else mask.to(device),
                                            use_cache=True).cache)
    if clock is not None:
        clock("prefill")
    per_layer = [attention_weights(*captured[index], cache[index][0], lengths.cpu(), settings) for index in read]
    scores = pool(per_layer, settings.pooling)
    if clock is not None:
        clock("scores")
    return cache, scores


def query_slots(lengths: torch.Tensor, settings: SpeculativeParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's last m slots, (B, M) with M the largest m of the batch, and which of them are real (B, M)."""
    counts = torch.tensor([settings.spans(int(length))[1] for length in lengths])  # (B,)
    width = max(int(counts.max()), 1)
    offsets = torch.arange(width)[None]  # (1, M)
    valid = offsets < counts[:, None]  # (B, M)
    slots = (lengths[:, None] - counts[:, None] + offsets).clamp(min=0)  # (B, M)
    return torch.where(valid, slots, 0), valid


def attention_weights(module, hidden: torch.Tensor, rotary: tuple, keys_rotated: torch.Tensor, lengths: torch.Tensor,
                      settings: SpeculativeParams) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's softmax weights (B, Hq, M, P), float32 on the CPU, of its last-m queries over the cache's keys,
    and which queries are real (B, M)."""
    slots, valid = query_slots(lengths, settings)  # (B, M)
    width = hidden.shape[1]

    def rows(states: torch.Tensor) -> torch.Tensor:  # (B or 1, P, X) -> (B, M, X): the last m of each row
        index = slots.to(states.device)[:, :, None].expand(-1, -1, states.shape[-1])  # (B, M, X)
        return states.expand(len(slots), -1, -1).gather(1, index)

    cos, sin = (rows(part) for part in rotary)  # (B, M, D) each
    queries = projections.rotate(projections.queries(module, rows(hidden)), cos, sin).float().cpu()  # (B, Hq, M, D)
    keys = keys_rotated.float().cpu().repeat_interleave(module.num_key_value_groups, dim=1)  # (B, Hq, P, D)
    logits = (queries @ keys.transpose(2, 3)) * module.scaling  # (B, Hq, M, P)
    seen = (torch.arange(width)[None, None] <= slots[:, :, None]) & real_slots(lengths, width)[:, None]  # (B, M, P)
    logits = logits.masked_fill(~seen[:, None], float("-inf"))
    return logits.softmax(dim=-1), valid


def pool(per_layer: list[tuple[torch.Tensor, torch.Tensor]], pooling: str) -> torch.Tensor:
    """(B, P): every layer's weights (B, Hq, M, P) pooled over layers, heads and the real queries."""
    weights = torch.stack([w for w, _ in per_layer], dim=1)  # (B, L, Hq, M, P)
    valid = per_layer[0][1][:, None, None, :, None]  # (B, 1, 1, M, 1)
    weights = weights.masked_fill(~valid, 0.0)
    if pooling == "max":
        return weights.amax(dim=(1, 2, 3))
    count = valid.sum(dim=3).clamp(min=1) * weights.shape[1] * weights.shape[2]  # (B, 1, 1, 1)
    return weights.sum(dim=(1, 2, 3)) / count.flatten()[:, None]


def keep_positions(scores: torch.Tensor, lengths: torch.Tensor, settings: SpeculativeParams, share: float
                   ) -> torch.Tensor:
    """(B, K) the positions each row keeps, ascending, -1 pads: its sinks, its last m and the best-scored round(p x
    rest) of the others (ties: the earlier position)."""
    rows = []
    for row, length in enumerate(lengths.tolist()):
        sinks, last = settings.spans(length)
        middle = torch.arange(sinks, length - last)  # the candidates
        order = torch.sort(-scores[row, sinks : length - last].float(), stable=True).indices
        picked = middle[order[: chosen(share, len(middle))]]
        rows.append(torch.cat([torch.arange(sinks), picked, torch.arange(length - last, length)]).sort().values)
    return padded_positions(rows)
