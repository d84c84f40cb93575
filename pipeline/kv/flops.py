"""Multiply-add counts of target prefill and of the handoff, and the speedup bounds they imply: what a handoff could
gain if time were proportional to work (PROTOCOL.md, "Latency study"). Counted: the linear layers (q, k, v, o, MLP;
embeddings are lookups), attention of each position over itself and all before, the mapper's matrices, and the last
position's logits only (the source computes none). Norms, RoPE and activations are elementwise: under 1% here.

    target prefill:  c[0] ... c[n-1]                        n tokens + 1 logit row
    handoff:         source c[0] ... c[n-2]                 n-1 tokens, no logits
                     map                                    n-1 tokens
                     target step c[n-1] over n-1 cached     1 token + 1 logit row
    repair over P = n-1:
        exact_layers m    layers 0..m-2 in full over P tokens, layer m-1's K/V projections over P tokens
        sink s            s tokens through every layer, attention over themselves
        tokens rho        round(rho (P - s)) tokens through every layer, each reading P + chosen keys (the 4D
                          mask's dense reads: an upper bound on the causal count)
        selection         the selector's own `cost` (source_attention: the source's look-ahead scores)
    speculative at share p, K kept of P:
        source P tokens, no logits; its look-ahead scores; the target's prefill of the K kept among themselves;
        the target's step c[n-1] over the K kept slots, 1 token + 1 logit row
"""
from __future__ import annotations

import math

from pipeline.kv.families import FAMILIES, Geometry
from pipeline.kv.geometry import kv_geometry
from pipeline.kv.repair import Repair
from pipeline.kv.selectors import Work
from pipeline.kv.speculative import SpeculativeParams


def linear_macs_per_token(config) -> int:
    """Multiply-adds per token of all non-embedding linear layers."""
    head_dim = kv_geometry(config)["head_dim"]
    hidden, layers = config.hidden_size, config.num_hidden_layers
    query = config.num_attention_heads * head_dim
    key_value = config.num_key_value_heads * head_dim
    attention = hidden * query + 2 * hidden * key_value + query * hidden  # q, k, v, o projections
    mlp = 3 * hidden * config.intermediate_size  # gate, up, down
    return layers * (attention + mlp)


def attention_macs(config, start: int, end: int) -> int:
    """Multiply-adds of attention for positions start..end-1, each over itself and all before: position p reads
    p + 1 keys and values, sum over p of (p + 1) = (end (end + 1) - start (start + 1)) / 2."""
    width = config.num_attention_heads * kv_geometry(config)["head_dim"]
    keys_read = (end * (end + 1) - start * (start + 1)) // 2
    return 2 * width * config.num_hidden_layers * keys_read  # q.k and the sum over values


def logits_macs(config) -> int:
    return config.hidden_size * config.vocab_size


def _layer_sizes(source_config, target_config, k: int, family: str, width: int | None) -> tuple[int, int]:
    """(weights, biases) of one target layer and kind of a `family` map."""
    spec = FAMILIES[family]
    shapes = spec.shapes(Geometry.of(kv_geometry(source_config), kv_geometry(target_config)), k, width)
    sizes = [(name.endswith("bias"), math.prod(shape)) for name, shape in zip(spec.tensor_names, shapes)]
    return sum(n for bias, n in sizes if not bias), sum(n for bias, n in sizes if bias)


def mapper_macs_per_token(source_config, target_config, k: int, family: str, width: int | None = None) -> int:
    """Multiply-adds per token of a keys+values mapper: one per weight, biases are adds."""
    weights, _ = _layer_sizes(source_config, target_config, k, family, width)
    return 2 * kv_geometry(target_config)["layers"] * weights  # keys and values


def mapper_parameter_count(source_config, target_config, k: int, family: str, width: int | None = None) -> int:
    """Parameters (weights and biases) of a keys+values mapper of `family`."""
    weights, biases = _layer_sizes(source_config, target_config, k, family, width)
    return 2 * kv_geometry(target_config)["layers"] * (weights + biases)


def target_prefill_macs(target_config, length: int) -> int:
    return (length * linear_macs_per_token(target_config) + attention_macs(target_config, 0, length)
            + logits_macs(target_config))


def matched_self_layers(source_config, target_config, length: int) -> int:
    """The n in 1..L-1 of the `self:<n>` source whose prefill costs nearest the real source's: the target's first n
    layers cost n/L of its body."""
    source = handoff_macs(source_config, target_config, 0, length)["source"]
    per_layer = handoff_macs(target_config, target_config, 0, length)["source"] / target_config.num_hidden_layers
    return min(max(round(source / per_layer), 1), target_config.num_hidden_layers - 1)


def handoff_macs(source_config, target_config, mapper_macs_per_token: int, length: int) -> dict[str, int]:
    """Multiply-adds of the handoff's three parts for a prompt of `length` tokens."""
    prefix = length - 1
    return {
        "source": prefix * linear_macs_per_token(source_config) + attention_macs(source_config, 0, prefix),
        "map": prefix * mapper_macs_per_token,
        "step": linear_macs_per_token(target_config)
        + attention_macs(target_config, prefix, length)
        + logits_macs(target_config),
    }


def kv_projection_macs_per_token(config) -> int:
    return 2 * config.hidden_size * config.num_key_value_heads * kv_geometry(config)["head_dim"]


def lookahead_macs(source_config, settings: SpeculativeParams, length: int) -> int:
    """Multiply-adds of the source's look-ahead scores of a prompt's prefix (P = length - 1): in each layer read, the
    last m queries' projection again and q.k over the keys each sees (the query at p reads p + 1)."""
    prefix = length - 1
    _, last = settings.spans(prefix)
    width = source_config.num_attention_heads * kv_geometry(source_config)["head_dim"]
    keys_read = (prefix * (prefix + 1) - (prefix - last) * (prefix - last + 1)) // 2
    layers = len(settings.layer_indices(source_config.num_hidden_layers))
    return layers * (last * source_config.hidden_size * width + width * keys_read)


def source_scores_macs(source_config, repair: Repair, settings: SpeculativeParams | None, length: int) -> int | None:
    """`lookahead_macs` where `repair`'s policy ranks by the source's scores, else None."""
    if not repair.reads_source:
        return None
    if settings is None:
        raise ValueError(f"repair {repair}: its selection reads the source's look-ahead scores; give the declared "
                         f"`speculative` settings")
    return lookahead_macs(source_config, settings, length)


def speculative_macs(source_config, target_config, settings: SpeculativeParams, share: float, length: int
                     ) -> dict[str, int]:
    prefix = length - 1
    kept = settings.kept(share, prefix)
    return {
        "source": handoff_macs(source_config, target_config, 0, length)["source"],
        "scores": lookahead_macs(source_config, settings, length),
        "target": kept * linear_macs_per_token(target_config) + attention_macs(target_config, 0, kept),
        "step": linear_macs_per_token(target_config) + attention_macs(target_config, kept, kept + 1)
        + logits_macs(target_config),
    }


def speculative_bound(source_config, target_config, settings: SpeculativeParams, share: float, length: int) -> float:
    """Target prefill over speculative prefill (p = 1 costs the source's prefill more, not less)."""
    return target_prefill_macs(target_config, length) / sum(
        speculative_macs(source_config, target_config, settings, share, length).values())


def repair_macs(target_config, repair: Repair, length: int, source_scores: int | None = None) -> dict[str, int]:
    """Multiply-adds of a repair's parts for a prompt of `length` tokens; `source_scores`: `lookahead_macs`."""
    prefix, layers = length - 1, target_config.num_hidden_layers
    per_layer = linear_macs_per_token(target_config) // layers  # one layer's linear work per token
    read = 2 * target_config.num_attention_heads * kv_geometry(target_config)["head_dim"]  # q.k and values, per key
    exact = repair.exact_layers
    sink = min(repair.sink, prefix)
    chosen = repair.chosen(prefix)
    selection = 0
    if repair.tokens:
        if repair.selector.reads_source and source_scores is None:
            raise ValueError(f"repair {repair}: its selection costs the source's look-ahead scores; give source_scores "
                             f"(kv.flops.lookahead_macs)")
        geometry = kv_geometry(target_config)
        work = Work(prefix, layers, exact, linear_macs_per_token(target_config),
                    kv_projection_macs_per_token(target_config), read, geometry["kv_heads"] * geometry["head_dim"],
                    source_scores or 0)
        selection = repair.selector.cost(work, repair.argument)
    return {
        "exact_layers": 0 if not exact else (exact - 1) * (prefix * per_layer + attention_macs(
            target_config, 0, prefix) // layers) + prefix * kv_projection_macs_per_token(target_config),
        "sink": sink * linear_macs_per_token(target_config) + attention_macs(target_config, 0, sink),
        "tokens": chosen * linear_macs_per_token(target_config) + chosen * (prefix + chosen) * read * layers,
        "selection": selection,
    }


def repair_budget(target_config, repair: Repair, length: int, source_scores: int | None = None) -> float:
    """A repair's multiply-adds as a fraction of the target's prefill of the same prompt."""
    return sum(repair_macs(target_config, repair, length, source_scores).values()) / target_prefill_macs(
        target_config, length)


def speedup_bound(source_config, target_config, mapper_macs_per_token: int, length: int,
                  repair: Repair = Repair(), source_scores: int | None = None) -> float:
    """Target prefill over the handoff (with `repair`'s multiply-adds)."""
    handoff = sum(handoff_macs(source_config, target_config, mapper_macs_per_token, length).values())
    if not repair.empty:
        handoff += sum(repair_macs(target_config, repair, length, source_scores).values())
    return target_prefill_macs(target_config, length) / handoff


def source_alone_bound(source_config, target_config, length: int) -> float:
    """Target prefill over the source model's own prefill of the same prompt (its logits included)."""
    return target_prefill_macs(target_config, length) / target_prefill_macs(source_config, length)


def truncated_bound(target_config, keep: float, length: int) -> float:
    """Target prefill over its prefill of the prompt's last round(keep x length) tokens (at least one)."""
    return target_prefill_macs(target_config, length) / target_prefill_macs(target_config, max(1, round(keep * length)))


def first_step_macs(source_config, target_config, length: int, mapper_macs_per_token: int = 0,
                    repair: Repair = Repair(), settings: SpeculativeParams | None = None,
                    share: float | None = None) -> dict[str, int]:
    """Multiply-adds of a handoff's first step by the parts its clock times; `share` given: speculative prefill's."""
    if share is not None:
        parts = speculative_macs(source_config, target_config, settings, share, length)
        return {"prefill": parts["source"], "scores": parts["scores"], "sparse": parts["target"],
                "step": parts["step"]}
    parts = handoff_macs(source_config, target_config, mapper_macs_per_token, length)
    out = {"prefill": parts["source"], "map": parts["map"], "step": parts["step"]}
    if not repair.empty:
        scores = source_scores_macs(source_config, repair, settings, length)  # None where the policy reads none
        total = sum(repair_macs(target_config, repair, length, scores).values())
        out |= {"scores": scores or 0, "repair": total - (scores or 0)}  # the selection by them is the scores
    return out
