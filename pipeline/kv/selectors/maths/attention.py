"""The maths of `attention` (`kv/selectors/attention.py`): the last prefix token's attention over the cache, read in
one more step of one token."""
from __future__ import annotations

from pipeline.kv import projections
from pipeline.kv.kvcache import additive_mask, layers_to_cache, real_slots
from pipeline.kv.selectors import attention
from pipeline.kv.selectors.maths.base import Evidence, SelectorMaths
from pipeline.store.lazy import lazy

torch = lazy("torch")


class AttentionMaths(SelectorMaths):
    declaration = attention.SELECTOR

    def score(self, evidence: Evidence, argument) -> torch.Tensor:
        return attention_scores(evidence.target, evidence.layers, evidence.prefix_ids, evidence.lengths,
                                evidence.count, evidence.devices)


def attention_scores(target, layers: list, prefix_ids: torch.Tensor, lengths: torch.Tensor, count,
                     devices) -> torch.Tensor:
    """(B, P): the attention of each row's last prefix token c[len-1], read once more at its position over the
    cache, summed over layers and heads; slot len-1 scores the weight on its fresh key (one extra step)."""
    batch, width = prefix_ids.shape
    last = (lengths - 1).clamp(min=0)  # (B,)
    tokens = prefix_ids.cpu().gather(1, last[:, None])  # (B, 1)
    allowed = torch.cat([real_slots(last, width), torch.ones(batch, 1, dtype=torch.bool)], dim=1)  # (B, P + 1)
    dtype = target.dtype
    mask = additive_mask(allowed[:, None, None], dtype)  # (B, 1, 1, P + 1)
    captured: list = []

    def keep(module, args, kwargs, output):
        captured.append((module, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0],
                         kwargs["position_embeddings"]))

    decoder = target.model
    hooks = [layer.self_attn.register_forward_hook(keep, with_kwargs=True) for layer in decoder.layers]
    cache = layers_to_cache(layers, target.config, dtype, devices or target.device)
    try:
        decoder(input_ids=tokens.to(target.device), cache=cache, use_cache=True, attention_mask=mask.to(target.device),
                position_ids=last[:, None].to(target.device))
    finally:
        for hook in hooks:
            hook.remove()
    count.forwards += 1
    count.token_layers += batch * target.config.num_hidden_layers
    scores = torch.zeros(batch, width + 1)
    for index, (module, hidden, (cos, sin)) in enumerate(captured):
        query = projections.rotate(projections.queries(module, hidden), cos, sin)  # (B, Hq, 1, D)
        keys = cache.layers[index].keys  # (B, H, P + 1, D)
        keys = keys.repeat_interleave(module.num_key_value_groups, dim=1).to(query.device)  # (B, Hq, P + 1, D)
        logits = (query.float() @ keys.float().transpose(2, 3)) * module.scaling  # (B, Hq, 1, P + 1)
        logits = logits + mask.float().to(logits.device)
        scores += logits.softmax(dim=-1).sum(dim=(1, 2)).cpu()  # (B, P + 1)
    own = scores[:, width]  # the last token's weight on its fresh key
    scores = scores[:, :width].clone()
    scores[torch.arange(batch), last] = own
    return scores


MATHS = AttentionMaths()
