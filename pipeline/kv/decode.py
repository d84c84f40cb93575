"""The decode loops that read the target after a handoff's cache. Contexts of different lengths batch together
right-padded and masked, each row at its own positions (a sparse cache has fewer slots than positions).
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Callable, Sequence

from pipeline.kv.handoff import FirstStep, Handoff
from pipeline.kv.kvcache import Layers, Prefixes, additive_mask, padded_prefixes, real_slots, segment_mask
from pipeline.store.devices import no_grad
from pipeline.store.lazy import lazy

torch = lazy("torch")
F = lazy("torch.nn.functional")
transformers = lazy("transformers")


@no_grad
def packed_logprobs(handoff: Handoff, layers: Layers | None, tokens: torch.Tensor, prefix_lengths: torch.Tensor,
                    segments: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Log-probabilities (B, L, V), float32, of continuations packed into rows (B, L) after each row's prefix cache.
    `segments` (B, L) numbers each token's continuation (-1 on padding), `offsets` (B, L) its place in it: a token
    sees its row's prefix and its own continuation's earlier tokens, at position prefix_lengths[b] + offset."""
    batch, steps = tokens.shape
    width = 0 if layers is None else layers[0][0].shape[2]
    prefix = real_slots(handoff.slots(prefix_lengths), width)[:, None].expand(-1, steps, -1)  # (B, L, P)
    allowed = torch.cat([prefix, segment_mask(segments)], dim=2)[:, None]  # (B, 1, L, P + L)
    mask = additive_mask(allowed, handoff.decoder.dtype)
    positions = prefix_lengths[:, None] + offsets  # (B, L)
    handoff.check_length(int(positions[segments >= 0].max()) + 1 if (segments >= 0).any() else 0)
    cache = handoff.decoder_cache(layers, batch)
    logits = handoff.decoder(input_ids=tokens.to(handoff.device), cache=cache, use_cache=cache is not None,
                         attention_mask=mask.to(handoff.device), position_ids=positions.to(handoff.device)).logits
    return F.log_softmax(logits.float(), dim=-1)


@no_grad
def prefilled_packed_logprobs(handoff: Handoff, prefix_ids: torch.Tensor, tokens: torch.Tensor,
                              segments: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`packed_logprobs` of one context (B = 1) whose prefix (1, P) the decoding model prefills in the same forward."""
    width, steps = prefix_ids.shape[1], tokens.shape[1]
    prefix = torch.cat([torch.ones(width, width, dtype=torch.bool).tril(), torch.zeros(width, steps, dtype=torch.bool)],
                       dim=1)  # (P, P + L)
    packed = torch.cat([torch.ones(steps, width, dtype=torch.bool), segment_mask(segments)[0]], dim=1)  # (L, P + L)
    allowed = torch.cat([prefix, packed])[None, None]  # (1, 1, P + L, P + L)
    mask = additive_mask(allowed, handoff.decoder.dtype)
    positions = torch.cat([torch.arange(width), width + offsets[0]])[None]  # (1, P + L)
    handoff.check_length(width + int(offsets[segments >= 0].max()) + 1)
    logits = handoff.decoder(input_ids=torch.cat([prefix_ids, tokens], dim=1).to(handoff.device),
                             attention_mask=mask.to(handoff.device), position_ids=positions.to(handoff.device),
                             logits_to_keep=steps).logits
    return F.log_softmax(logits.float(), dim=-1)


@no_grad
def greedy_rollout(handoff: Handoff, contexts: Sequence[Sequence[int]], steps: int) -> torch.Tensor:
    """Greedy tokens (B, steps) after the handed-off cache of each context[:-1] and its context[-1]."""
    prefixes = padded_prefixes(contexts)
    lengths = prefixes.lengths
    told = handoff.lengths_read(lengths, prefixes.padded) is not None  # padded rows, or slots that are not positions
    layers = handoff.prefix_layers(prefixes.ids, prefixes.padded_lengths)
    cache = handoff.decoder_cache(layers, len(contexts))
    if cache is None:
        cache = transformers.DynamicCache(config=handoff.decoder.config)
    next_input = prefixes.last.to(handoff.device)  # (B, 1)
    width = 0 if layers is None else layers[0][0].shape[2]
    mask = real_slots(handoff.slots(lengths), width).long()  # (B, K): the slots that hold each real prefix
    handoff.check_length(int(lengths.max()) + steps)  # the prefix, the context's last token, steps - 1 fed back
    tokens = []
    for step in range(steps):
        options = {}
        if told:
            mask = torch.cat([mask, torch.ones(len(contexts), 1, dtype=torch.long)], dim=1)  # (B, P + step + 1)
            options = {"attention_mask": mask.to(handoff.device),
                       "position_ids": (lengths[:, None] + step).to(handoff.device)}  # (B, 1)
        logits = handoff.decoder(input_ids=next_input, cache=cache, use_cache=True, logits_to_keep=1,
                                **options).logits
        next_input = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        tokens.append(next_input)
    return torch.cat(tokens, dim=1)


@no_grad
def teacher_forced(handoff: Handoff, prompts: Sequence[tuple[Sequence[int], Sequence[int]]],
                   attention: list | None = None) -> list[torch.Tensor]:
    """Per (context, continuation) prompt, the log-probabilities (m, V) scoring its continuation, in one batch.
    `attention` (a list) gets each prompt's attention outputs at those positions, (L_t, m, hidden) on the CPU."""
    prefixes = padded_prefixes([context for context, _ in prompts])
    layers = handoff.prefix_layers(prefixes.ids, prefixes.padded_lengths)
    told = handoff.lengths_read(prefixes.lengths, prefixes.padded)
    steps = torch.zeros(len(prompts), max(len(cont) for _, cont in prompts), dtype=torch.long)
    for row, (context, continuation) in enumerate(prompts):
        steps[row, : len(continuation)] = torch.tensor([context[-1], *continuation[:-1]])  # c[n-1] e[0] ... e[m-2]
    with attention_outputs(handoff.decoder) if attention is not None else nullcontext() as outputs:  # the step only
        logprobs = handoff.step_logprobs(layers, steps, told)  # (B, M, V)
    if attention is not None:
        stacked = torch.stack(outputs, dim=1)  # (B, L_t, M, hidden)
        attention.extend(stacked[row, :, : len(continuation)] for row, (_, continuation) in enumerate(prompts))
    return [logprobs[row, : len(continuation)] for row, (_, continuation) in enumerate(prompts)]


@no_grad
def read_after(handoff: Handoff, first: FirstStep, continuation: Sequence[int], horizon: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One context's two reads from its first step (batch 1): the log-probabilities (m, V), float32, teacher-forced
    through the continuation e, and the greedy rollout (horizon,) after the cache is cropped back:

        cache  c[0..n-2] c[n-1] | e[0] ... e[m-2]        -> scores e[1] ... e[m-1]
               c[0..n-2] c[n-1] | g[0] ... g[h-2]        -> g[1] ... g[h-1]   (g[0]: the first step's argmax)
    """
    cache, width = first.cache, first.cache.get_seq_length()  # the prefix's slots and c[n-1]'s
    context = int(first.prefixes.lengths[0]) + 1  # n: the position of the first token fed after the step
    logprobs = [first.logprobs]  # (1, V): e[0]
    if len(continuation) > 1:
        handoff.check_length(context + len(continuation) - 1)
        ids = torch.tensor([list(continuation[:-1])], device=handoff.device)  # (1, m - 1)
        logits = handoff.decoder(input_ids=ids, cache=cache, use_cache=True,
                                 position_ids=at(context, ids.shape[1], handoff.device)).logits  # (1, m - 1, V)
        logprobs.append(F.log_softmax(logits[0].float(), dim=-1))
        cache.crop(width - cache.get_seq_length())  # a negative count: the tokens fed after the step go
    handoff.check_length(context + horizon - 1)
    tokens = [first.logits.argmax(-1, keepdim=True)]  # (1, 1): g[0]
    for step in range(horizon - 1):
        logits = handoff.decoder(input_ids=tokens[-1], cache=cache, use_cache=True, logits_to_keep=1,
                                 position_ids=at(context + step, 1, handoff.device)).logits
        tokens.append(logits[:, -1].argmax(-1, keepdim=True))  # (1, 1)
    return torch.cat(logprobs), torch.cat(tokens, dim=1)[0]


def at(start: int, count: int, device) -> torch.Tensor:
    """(1, count) the positions start, start + 1, ... of tokens fed to one row."""
    return torch.arange(start, start + count, device=device)[None]


@contextmanager
def attention_outputs(model):
    """Yields a list of every decoder layer's attention output (B, T, hidden) per forward, on the CPU."""
    outputs: list[torch.Tensor] = []

    def record(module, inputs, output) -> None:
        outputs.append(output[0].detach().cpu())

    hooks = [layer.self_attn.register_forward_hook(record) for layer in model.get_decoder().layers]
    try:
        yield outputs
    finally:
        for hook in hooks:
            hook.remove()


@no_grad
def decode(handoff: Handoff, context: Sequence[int], max_new_tokens: int,
           choose: Callable[[torch.Tensor], int] = lambda logits: int(logits.argmax()),
           on_token: Callable[[list[int]], bool] = lambda tokens: False) -> list[int]:
    """The tokens decoded after the handoff's first step on `context`, each `choose(logits)` (default: the greedy
    one); `on_token(tokens so far)` True stops there."""
    tokens: list[int] = []
    if max_new_tokens <= 0:
        return tokens
    first = handoff.first_step(Prefixes.of(torch.tensor([list(context)], dtype=torch.long)))
    cache, logits = first.cache, first.logits[0]  # (V,)
    while True:
        tokens.append(choose(logits))
        if on_token(tokens) or len(tokens) == max_new_tokens:
            return tokens
        handoff.check_length(len(context) + len(tokens))
        next_input = torch.tensor([[tokens[-1]]], device=handoff.device)  # (1, 1)
        logits = handoff.decoder(input_ids=next_input, cache=cache, use_cache=True, logits_to_keep=1,
                                 position_ids=at(len(context) + len(tokens) - 1, 1, handoff.device)).logits[0, -1]


def full_logprobs(target, context, continuation) -> torch.Tensor:
    """The plain forward's log-probabilities (m, V) at the positions scoring the continuation."""
    ids = torch.tensor([list(context) + list(continuation)]).to(target.device)
    logprobs = torch.log_softmax(target(input_ids=ids).logits.float(), -1)[0]
    return logprobs[len(context) - 1 : len(context) + len(continuation) - 1]


def chunked_logprobs(target, context, continuation) -> torch.Tensor:
    """`full_logprobs` in three chunks through the model's own cache: equal in maths, so off by float rounding only."""
    ids = torch.tensor([list(context) + list(continuation)]).to(target.device)
    cut, last = max(1, (len(context) - 1) // 2), len(context) - 1
    cache = transformers.DynamicCache(config=target.config)
    for start, end in ((0, cut), (cut, last)):
        if end > start:
            target(input_ids=ids[:, start:end], cache=cache, use_cache=True)
    logits = target(input_ids=ids[:, last:-1], cache=cache, use_cache=True).logits
    return torch.log_softmax(logits.float(), -1)[0]


def eos_ids(model, tokenizer) -> set[int]:
    """The ids that end a continuation: the generation config's EOS (an id or a list) and the tokenizer's."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(ids if isinstance(ids, (list, tuple)) else [] if ids is None else [ids])
    return ids | ({tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set())


def generate(handoff: Handoff, prompt: Sequence[int], max_new_tokens: int, stop: set[int] = frozenset(),
             temperature: float = 0.0, seed: int = 0,
             on_token: Callable[[list[int]], None] = lambda tokens: None) -> tuple[list[int], float]:
    """(the tokens decoded after the handoff of `prompt`, the time to first token in ms); stops after a token in
    `stop`. A token is the argmax at temperature 0, else a draw on the CPU (so a seed draws alike on any device)."""
    generator = torch.Generator().manual_seed(seed)
    start, first_ms = time.perf_counter(), []

    def pick(logits: torch.Tensor) -> int:
        if temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)  # (V,)
        return int(torch.multinomial(probs, 1, generator=generator))

    def seen(tokens: list[int]) -> bool:
        if len(tokens) == 1:
            first_ms.append(1000 * (time.perf_counter() - start))
        on_token(tokens)
        return tokens[-1] in stop

    tokens = decode(handoff, prompt, max_new_tokens, pick, seen)
    return tokens, (first_ms[0] if first_ms else 0.0)
