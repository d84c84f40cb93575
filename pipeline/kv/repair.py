"""Repair: after the map, the target recomputes part of the prefix cache itself before its first step.

A setting (`Repair`) is applied to a target-space cache (rotated, target dtype) of prefix tokens c[0..P-1] in a
fixed order, each part over what the parts before it left:

    1. exact_layers n   the target's own keys/values of layers 0..n-1 over the whole prefix: layers 0..n-2 in
                        full, then only the input norm and K/V projections of layer n-1 (n = 1: the embedding's
                        K/V alone); no logits
    2. sink s           the target's own prefill of c[0..s-1], every layer
    3. tokens rho       round(rho x (P - s)) of the remaining tokens c[s..P-1], chosen by `select_by`, recomputed in
                        one forward of the decoder body: each at its own position, seeing the cache of the tokens
                        before it (mapped, or recomputed in the same forward), a 4D mask as `decode.packed_logprobs`

    chosen by     a selector (`kv/selectors/`, one module each, listed in its registry): deviation (the mapped
                  keys/values furthest from the target's exact ones at layer n-1), attention (what the first step
                  attends to), recency (the prompt's end), key_norm (the largest mapped keys); `POLICY@VALUE` gives a
                  policy its own parameter where it takes one (`key_norm@2`)

Known answers: exact_layers = L, sink = P and rho = 1 each give the oracle's cache within float rounding; the
empty setting returns the cache untouched. The string form (`none`, `layers:1`, `sink:4+tokens:0.1:attention`,
`tokens:0.1:key_norm@2`) has one parser, `Repair.parse`; its parts are joined by `+` in any order and applied in
the order above.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pipeline.kv import projections
from pipeline.kv.kvcache import Layers, cache_to_layers, layers_to_cache
from pipeline.kv.selectors.base import EXACT, Evidence, Selector
from pipeline.kv.selectors.registry import POLICIES, SELECTORS
from pipeline.store.cli import Refusal
from pipeline.store.lazy import lazy
from pipeline.store.params import ParamError

torch = lazy("torch")
transformers = lazy("transformers")

REPAIR_FORM = "none, or parts joined by '+': layers:N, sink:S, tokens:RHO:POLICY (POLICY: " + "|".join(
    name + ("" if selector.parameter is None else f"[@N: {selector.parameter}]") for name, selector in SELECTORS.items()
) + ")"


class RepairError(Refusal, ValueError):
    """A malformed repair setting: one line naming the bad part (a command prints it as `error: ...`, exit 2)."""


@dataclass(frozen=True)
class Repair:
    """One repair setting; the empty one (`Repair()`, `none`) is the mapped cache as it is."""

    exact_layers: int = 0
    sink: int = 0
    tokens: float = 0.0  # rho: the fraction of the prefix tokens after the sink
    select_by: str = "recency"
    argument: int | float | None = None  # the policy's own parameter (`POLICY@VALUE`), None where it takes none

    def __post_init__(self):
        if self.exact_layers < 0 or self.sink < 0:
            raise RepairError(f"repair {self}: exact layers and sink are counts >= 0")
        if not 0.0 <= self.tokens <= 1.0:
            raise RepairError(f"repair tokens:{self.tokens:g}: the fraction must be in [0, 1]")
        if self.select_by not in POLICIES:
            raise RepairError(f"repair select_by {self.select_by!r}: known {', '.join(POLICIES)}")
        problem = self.selector.refusal(self.argument, None)
        if problem:
            raise RepairError(f"repair {self}: {problem}")

    @classmethod
    def parse(cls, text: str) -> Repair:
        """The setting of its string form (REPAIR_FORM); a bad part raises one line naming it."""
        text = str(text).strip()
        if text in ("", "none"):
            return cls()
        fields: dict = {}
        for part in text.split("+"):
            name, *values = part.strip().split(":")
            key = {"layers": "exact_layers", "sink": "sink", "tokens": "tokens"}.get(name)
            if key is None or key in fields or len(values) != (2 if key == "tokens" else 1):
                raise RepairError(f"repair {text!r}: bad part {part!r} (form: {REPAIR_FORM})")
            try:
                if key == "tokens":
                    name, at, argument = values[1].partition("@")
                    fields["tokens"], fields["select_by"] = float(values[0]), name
                    if name not in POLICIES or not math.isfinite(fields["tokens"]):
                        raise ValueError
                    if at:
                        fields["argument"] = SELECTORS[name].read(argument)
                else:
                    fields[key] = int(values[0])
            except ValueError:
                raise RepairError(f"repair {text!r}: bad part {part!r} (form: {REPAIR_FORM})") from None
        return cls(**fields)

    def __str__(self) -> str:
        parts = ([f"layers:{self.exact_layers}"] if self.exact_layers else []) + (
            [f"sink:{self.sink}"] if self.sink else []) + (
            [f"tokens:{self.tokens:g}:{self.policy}"] if self.tokens else [])
        return "+".join(parts) or "none"

    @property
    def policy(self) -> str:
        """The token choice as the string form writes it: the policy, and `@VALUE` where it has a parameter."""
        return self.select_by + ("" if self.argument is None else f"@{self.argument:g}")

    @property
    def selector(self) -> Selector:
        return SELECTORS[self.select_by]

    def policy_refusal(self, layers: int) -> str | None:
        """Why the token policy cannot read a target of `layers` decoder layers (`key_norm@N` past them); None when
        it can, or when no tokens are recomputed (then no policy runs)."""
        return self.selector.refusal(self.argument, layers) if self.tokens else None

    @property
    def empty(self) -> bool:
        return not (self.exact_layers or self.sink or self.tokens)

    def chosen(self, length: int) -> int:
        """Tokens the `tokens` part recomputes in a prefix of `length` (after the sink)."""
        return math.floor(self.tokens * max(length - self.sink, 0) + 0.5)



def parse_grid(texts: list[str], key: str, why_none: str) -> list[Repair]:
    """A declared list of settings (params' `key`): each parsed, none named twice (by canonical form), `none` among
    them (`why_none` says what it is there for); a failure is one line naming the key."""
    settings = []
    for text in texts:
        try:
            settings.append(Repair.parse(text))
        except RepairError as error:
            raise ParamError(f"{key}: {error}") from None
    if len({str(setting) for setting in settings}) != len(settings):
        raise ParamError(f"{key}: a setting is named twice (compare their canonical forms); drop one")
    if "none" not in texts:
        raise ParamError(f"{key}: add `none`, {why_none}")
    return settings


@dataclass
class RepairCount:
    """What repairs made the target compute, for tests and `generate`: forwards of the decoder (or of its first
    layers), token-layers through a full decoder layer, and the tokens each recomputed in every layer."""

    forwards: int = 0
    token_layers: int = 0
    recomputed: int = 0  # sink and chosen tokens, over every row
    log: list = field(default_factory=list)  # per call: (recomputed tokens, seconds), for generate's print


def repair_cache(target, layers: Layers, prefix_ids: torch.Tensor, lengths: torch.Tensor | None, setting: Repair,
                 count: RepairCount, devices=None) -> Layers:
    """`layers` (per layer (B, H, P, D), rotated, target dtype) of prefix_ids (B, P) repaired by `setting`;
    `lengths` (B,) the real lengths of right-padded rows (None: every row is whole); `devices`: where each layer's
    cache goes (`kv.kvcache.layer_devices`), None for the target's device."""
    if setting.empty:
        return layers
    batch, width = prefix_ids.shape
    config = target.config
    if setting.exact_layers > config.num_hidden_layers:
        raise RepairError(f"repair {setting}: the target has only {config.num_hidden_layers} layers")
    selector = setting.selector if setting.tokens else None
    problem = setting.policy_refusal(config.num_hidden_layers)
    if problem:
        raise RepairError(f"repair {setting}: {problem}")
    lengths = torch.full((batch,), width) if lengths is None else lengths.cpu()
    mapped, layers = layers, [(k.clone(), v.clone()) for k, v in layers]
    exact_index = max(setting.exact_layers - 1, 0)
    exact = None
    if setting.exact_layers or (selector and EXACT in selector.needs):
        exact = exact_layers(target, prefix_ids, max(setting.exact_layers, 1), count)
        for index in range(setting.exact_layers):
            layers[index] = tuple(t.to(layers[index][0].device, layers[index][0].dtype) for t in exact[index])
    sink = min(setting.sink, width)
    if sink:
        mask = (torch.arange(sink)[None] < lengths[:, None]).long()  # (B, s)
        out = target.model(input_ids=prefix_ids[:, :sink].to(target.device), attention_mask=mask.to(target.device),
                           use_cache=True).cache
        count.forwards += 1
        count.token_layers += batch * sink * config.num_hidden_layers
        count.recomputed += int(lengths.clamp(max=sink).sum())
        for index, (keys, values) in enumerate(cache_to_layers(out)):
            layers[index][0][:, :, :sink] = keys.to(layers[index][0].device)
            layers[index][1][:, :, :sink] = values.to(layers[index][1].device)
    if not setting.tokens:
        return layers
    chosen_per_row = [setting.chosen(int(n)) for n in lengths]
    if max(chosen_per_row) == 0:
        return layers
    evidence = Evidence(target, layers, mapped, None if exact is None else exact[exact_index], exact_index,
                        prefix_ids, lengths, count, devices)
    scores = selector.score(evidence, setting.argument)  # (B, P)
    chosen = choose(scores, lengths, sink, chosen_per_row)  # (B, M), -1 past a row's count
    return recompute(target, layers, prefix_ids, lengths, chosen, count, devices)


def choose(scores: torch.Tensor, lengths: torch.Tensor, sink: int, counts: list[int]) -> torch.Tensor:
    """Per row, the positions (ascending) of its `counts[b]` highest scores among slots sink..lengths[b]-1;
    (B, M) padded with -1."""
    batch, width = scores.shape
    slots = torch.arange(width)[None]  # (1, P)
    eligible = (slots >= sink) & (slots < lengths[:, None])  # (B, P)
    ranked = scores.float().cpu().masked_fill(~eligible, -math.inf)
    top = ranked.topk(max(counts), dim=1).indices  # (B, M)
    chosen = torch.full_like(top, -1)
    for row, n in enumerate(counts):
        chosen[row, :n] = top[row, :n].sort().values
    return chosen


def _causal_mask(batch: int, width: int, dtype) -> torch.Tensor:
    """(B, 1, P, P) additive causal mask: right padding never reaches a real token."""
    allowed = torch.ones(width, width, dtype=torch.bool).tril()
    mask = torch.zeros(width, width, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].expand(batch, 1, -1, -1)


def exact_layers(target, prefix_ids: torch.Tensor, n: int, count: RepairCount) -> Layers:
    """The target's own keys/values (B, H, P, D), rotated, of its first n layers over prefix_ids (B, P): layers
    0..n-2 in full, layer n-1's input norm and K/V projections only; no logits."""
    decoder = target.model
    batch, width = prefix_ids.shape
    hidden = decoder.embed_tokens(prefix_ids.to(target.device))  # (B, P, hidden)
    positions = torch.arange(width, device=target.device)[None].expand(batch, -1)  # (B, P)
    cos, sin = decoder.rotary_emb(hidden, positions)  # (B, P, D) each
    cache = transformers.DynamicCache(config=target.config)
    mask = _causal_mask(batch, width, hidden.dtype).to(target.device)
    for layer in decoder.layers[: n - 1]:
        hidden = layer(hidden, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                       position_embeddings=(cos, sin))
        hidden = hidden[0] if isinstance(hidden, tuple) else hidden
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
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
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
