"""The handoff under the last-token protocol, in every mode the study compares.

For context tokens c[0..n-1] and a continuation e (PROTOCOL.md, "Handoff"):

    source body:  c[0] ... c[n-2]                 -> cache (no logits computed)
                  strip source RoPE -> map -> [shuffle] -> apply target RoPE -> cast to target dtype
    target:       cache + c[n-1] e[0] ... e[m-2]  -> logits scoring e[0] ... e[m-1]

Modes: `oracle` (the target's own prefill of c[0..n-2]), `direct` (the source cache unmapped; needs equal KV
geometry), `mapped` (through a fitted mapper), and the null controls `zero` (an all-zero cache of the
target's shape) and `shuffled` (what `mapped` would inject, or the source cache without a mapper, with its
token order permuted by a seeded permutation in content space, before the target's RoPE).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import DynamicCache

from pipeline.kv.contract import pair_contract
from pipeline.kv.kvcache import Layers, cache_to_layers, expand_batch, kv_geometry, layers_to_cache
from pipeline.kv.mapper import Mapper
from pipeline.kv.rope import RotarySpec, Rotation
from pipeline.store.models import IncompatiblePairError

MODES = ("oracle", "direct", "mapped", "zero", "shuffled")


class Handoff:
    """Builds the target's prefix cache in one of MODES and scores tokens after it."""

    def __init__(self, target, source=None, mode: str = "oracle", mapper: Mapper | None = None, shuffle_seed: int = 0,
                 tokenizers: tuple | None = None, max_tokens: int | None = None):
        """`tokenizers`: (source, target) tokenizers, compared by the contract when given (otherwise only the
        vocabulary sizes can be); `max_tokens`: the longest sequence this handoff will see (a sliding window
        shorter than it is refused), by default the target's position range."""
        if mode not in MODES:
            raise ValueError(f"unknown transfer mode {mode!r} (known: {', '.join(MODES)})")
        if mode not in ("oracle", "zero") and source is None:
            raise ValueError(f"transfer mode {mode!r} needs a source model")
        if mode == "mapped" and mapper is None:
            raise ValueError("transfer mode 'mapped' needs a mapper")
        self.target, self.source, self.mode, self.mapper, self.shuffle_seed = target, source, mode, mapper, shuffle_seed
        source_tokenizer, target_tokenizer = tokenizers or (None, None)
        # the contract decides from the configs, before any forward; the rotary buffers are then checked
        self.contract = pair_contract(target.config, source.config if mode not in ("oracle", "zero") else None,
                                      target_tokenizer, source_tokenizer, max_tokens)
        self.contract.require(mode)
        self.target_spec = RotarySpec.from_model(target)
        self.target_geometry = kv_geometry(target.config)
        self.source_prefills = 0  # counted so tests can check that shared contexts share one prefill
        if mode in ("oracle", "zero"):
            return
        self.source_spec = RotarySpec.from_model(source)
        self.source_geometry = kv_geometry(source.config)
        names = f"source {source.config._name_or_path!r} and target {target.config._name_or_path!r}"
        if mapper is not None:
            if (mapper.source_geometry, mapper.target_geometry) != (self.source_geometry, self.target_geometry):
                raise IncompatiblePairError(
                    f"mapper was fitted for KV geometry {mapper.source_geometry} -> {mapper.target_geometry}, "
                    f"but {names} have {self.source_geometry} -> {self.target_geometry}"
                )
        elif self.source_geometry != self.target_geometry:
            raise IncompatiblePairError(
                f"transfer mode {mode!r} without a mapper needs equal KV geometry, but {names} have "
                f"{self.source_geometry} vs {self.target_geometry}; use transfer=mapped with a fitted mapper"
            )

    @property
    def device(self):
        return self.target.device

    @torch.no_grad()
    def prefix_layers(self, prefix_ids: torch.Tensor) -> Layers | None:
        """Target-space cache (rotated, target dtype) for prefix_ids (B, P); None for an empty prefix."""
        prefix_ids = prefix_ids.to(self.device)
        batch, length = prefix_ids.shape
        if length == 0:
            return None
        dtype = self.target.dtype
        if self.mode == "oracle":
            return cache_to_layers(self.target.model(input_ids=prefix_ids, use_cache=True).cache)
        if self.mode == "zero":
            shape = (batch, self.target_geometry["kv_heads"], length, self.target_geometry["head_dim"])
            zeros = torch.zeros(shape, dtype=dtype, device=self.device)
            return [(zeros, zeros) for _ in range(self.target_geometry["layers"])]

        return self.to_target(self.source_prefill(prefix_ids))

    @torch.no_grad()
    def source_prefill(self, prefix_ids: torch.Tensor) -> Layers:
        """The source's own cache for prefix_ids (1, P): its decoder body only, no logits."""
        self.source_prefills += 1
        return cache_to_layers(self.source.model(input_ids=prefix_ids.to(self.source.device), use_cache=True).cache)

    @torch.no_grad()
    def to_target(self, source_layers: Layers) -> Layers:
        """Source cache -> target-space cache (rotated, target dtype), per this handoff's mode."""
        dtype = self.target.dtype
        if self.mode == "direct" and self.source_spec == self.target_spec:
            return [(k.to(self.device, dtype), v.to(self.device, dtype)) for k, v in source_layers]

        length = source_layers[0][0].shape[2]
        positions = torch.arange(length, device=self.source.device)
        source_rotation = Rotation(self.source_spec, positions)
        content = [(source_rotation.strip(k.float()), v.float()) for k, v in source_layers]  # float32 content space
        order = None
        if self.mode == "shuffled":
            generator = torch.Generator().manual_seed(self.shuffle_seed)
            order = torch.randperm(length, generator=generator).to(positions.device)
        mapper = self.mapper if self.mode in ("mapped", "shuffled") else None
        target_rotation = Rotation(self.target_spec, positions.to(self.device))
        layers = []
        # one target layer at a time, from content space to the target's dtype: only one layer's float32
        # intermediates live at once beside the stripped source cache
        for layer in range(mapper.target_layers(content) if mapper else len(content)):
            keys, values = mapper.apply_layer(content, layer, positions) if mapper else content[layer]
            if order is not None:
                keys, values = keys[:, :, order], values[:, :, order]  # permute tokens, (B, H, T, D)
            # the linear map leaves values in (B, T, H, D) memory order; lay them out now, while only this
            # layer is live, not all at once when the cache is built
            values = values.to(self.device, dtype, memory_format=torch.contiguous_format)
            layers.append((target_rotation.apply(keys.to(self.device)).to(dtype), values))
        return layers

    def target_cache(self, layers: Layers | None, batch: int = 1):
        """A fresh target cache holding `layers`; a batch-1 prefix is shared by `batch` rows."""
        if layers is None:
            return None
        if layers[0][0].shape[0] != batch:
            layers = expand_batch(layers, batch)
        return layers_to_cache(layers, self.target.config, self.target.dtype, self.device)

    @torch.no_grad()
    def step_logprobs(self, layers: Layers | None, tokens: torch.Tensor) -> torch.Tensor:
        """Log-probabilities (B, L, V), float32, of the target reading tokens (B, L) after the prefix cache."""
        cache = self.target_cache(layers, tokens.shape[0])
        logits = self.target(input_ids=tokens.to(self.device), cache=cache, use_cache=cache is not None).logits
        return F.log_softmax(logits.float(), dim=-1)


def truncate(context: Sequence[int], continuation: Sequence[int], max_length: int) -> list[int]:
    """The context left after lm-eval's left-truncation of context + continuation to max_length + 1 tokens."""
    if len(continuation) > max_length:
        raise ValueError(f"continuation of {len(continuation)} tokens exceeds the model's {max_length}")
    whole = (list(context) + list(continuation))[-(max_length + 1) :]
    return whole[: len(whole) - len(continuation)]


def score_continuations(
    handoff: Handoff,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    batch_size: int = 8,
    max_length: int | None = None,
    progress: bool = True,
) -> list[tuple[float, bool]]:
    """Sum of log-probabilities of each continuation given its context, and whether it is the greedy one.

    Requests that share a context share one prefix cache (one source prefill): HellaSwag's four endings
    cost one prefill, not four. Within a context, continuations are batched with right padding, which
    causal attention never lets earlier positions see.
    """
    max_length = max_length or handoff.target.config.max_position_embeddings
    groups: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()
    for index, (context, continuation) in enumerate(requests):
        if not continuation:
            raise ValueError(f"request {index} has an empty continuation")
        groups.setdefault(tuple(truncate(context, continuation, max_length)), []).append(index)

    results: list[tuple[float, bool] | None] = [None] * len(requests)
    bar = tqdm(total=len(requests), desc=f"scoring ({handoff.mode})", unit="req", disable=not progress)
    for context, members in groups.items():
        if not context:
            raise ValueError("a request has an empty context; lm-eval prepends the prefix token to avoid this")
        layers = handoff.prefix_layers(torch.tensor([context[:-1]], dtype=torch.long))
        for start in range(0, len(members), batch_size):
            chunk = members[start : start + batch_size]
            conts = [list(requests[i][1]) for i in chunk]
            width = max(len(c) for c in conts)
            # step tokens: c[n-1] e[0] ... e[m-2], right-padded; position j scores e[j]
            steps = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, cont in enumerate(conts):
                steps[row, : len(cont)] = torch.tensor([context[-1]] + cont[:-1])
            logprobs = handoff.step_logprobs(layers, steps)  # (B, width, V)
            for row, (index, cont) in enumerate(zip(chunk, conts)):
                target_ids = torch.tensor(cont, device=logprobs.device)
                rows = logprobs[row, : len(cont)]  # (m, V)
                total = rows.gather(-1, target_ids[:, None]).sum().item()
                greedy = bool((rows.argmax(-1) == target_ids).all())
                results[index] = (total, greedy)
            bar.update(len(chunk))
    bar.close()
    return results  # type: ignore[return-value]


def _decoding_cache(handoff: Handoff, contexts: torch.Tensor):
    """The target cache to decode from: the handoff of contexts[:, :-1], or an empty cache."""
    cache = handoff.target_cache(handoff.prefix_layers(contexts[:, :-1]), contexts.shape[0])
    if cache is None:
        cache = DynamicCache(config=handoff.target.config)
    return cache


@torch.no_grad()
def greedy_rollout(handoff: Handoff, contexts: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy tokens (B, steps) after the handed-off cache of contexts[:, :-1] (B, n) and contexts[:, -1]."""
    contexts = contexts.to(handoff.device)
    cache = _decoding_cache(handoff, contexts)
    tokens, next_input = [], contexts[:, -1:]
    for _ in range(steps):
        logits = handoff.target(input_ids=next_input, cache=cache, use_cache=True, logits_to_keep=1).logits
        next_input = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        tokens.append(next_input)
    return torch.cat(tokens, dim=1)


@torch.no_grad()
def greedy_generate(
    handoff: Handoff,
    context: Sequence[int],
    max_new_tokens: int,
    should_stop: Callable[[list[int]], bool] = lambda tokens: False,
) -> list[int]:
    """Greedy tokens the target produces after the handed-off cache of context[:-1] and context[-1],
    stopping early when should_stop(tokens so far) says so."""
    cache = _decoding_cache(handoff, torch.tensor([list(context)], dtype=torch.long))
    generated: list[int] = []
    next_input = torch.tensor([[context[-1]]], device=handoff.device)
    for _ in range(max_new_tokens):
        logits = handoff.target(input_ids=next_input, cache=cache, use_cache=True, logits_to_keep=1).logits
        token = int(logits[0, -1].argmax())
        generated.append(token)
        if should_stop(generated):
            break
        next_input = torch.tensor([[token]], device=handoff.device)
    return generated
