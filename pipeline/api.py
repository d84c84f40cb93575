"""The handoff from a researcher's own code: a pair, a handoff, and its cache as a transformers `Cache`.

    import torch
    from pipeline.api import handed_off, handoff, pair

    models = pair("models/target", "models/source")  # two folders or hub ids; or pair("models/target", "self:2")
    mapped = handoff(models, "mapped", "models/mapper.safetensors", repair="layers:1")
    prompt = models.target_tokenizer.encode("story: ray teal toy . pat navy box .")
    handed = handed_off(mapped, prompt, max_new_tokens=8)  # prompt[:-1]'s cache as the handoff made it
    out = models.target.generate(torch.tensor([prompt]), cache=handed.cache, max_new_tokens=8)

`handed.cache` is a fresh `DynamicCache` of prompt[:-1] at positions 0..n-2: `generate` with the whole prompt reads
prompt[-1] and continues, as the pipeline decodes. Under `handoff(..., "source")` continue with `handed.model` (the
source; the target in every other mode). A map is bound to the models it was fitted on (`store.fingerprints`); each
argument is checked where it enters, by the rules generate's flags obey, and a wrong one is one line naming it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from pipeline.kv.handoff import Handoff
from pipeline.kv.kvcache import Layers
from pipeline.kv.pair import Pair, positions
from pipeline.kv.request import FIELDS, Face, Transfer
from pipeline.kv.router import Router
from pipeline.kv.routes import Route
from pipeline.store import inputs
from pipeline.store.devices import FACE_DTYPES, default_device, resolved
from pipeline.store.lazy import lazy
from pipeline.store.params import ParamError

torch = lazy("torch")

API = Face("pipeline.api", {**{field: field for field in FIELDS}, "mode": "mode"})  # refusals name keyword args


def pair(target: str, source: str | None = None, dtype: str = "float32", device: str | None = None,
         allow_other_models: bool = False, max_tokens: int | None = None) -> Pair:
    """The pair of `target` and `source` (folders, hub ids or `self:<n>`, the target's first n layers; None: target
    alone, for the oracle and zero modes) in `dtype` (`auto`: this machine's faster) on `device` (default: cuda if any,
    else cpu). Configs, tokenizers and contract load now, weights on first use. `max_tokens`: the longest sequence it
    will see (a shorter sliding window is refused now); `allow_other_models`: accept a map fitted on other models."""
    inputs.choice(dtype, "pair() dtype", FACE_DTYPES)
    if max_tokens is not None:
        inputs.at_least(max_tokens, "pair() max_tokens", 1)
    device = inputs.device(device, "pair() device") if device is not None else default_device()
    return Pair(str(target), None if source is None else str(source), resolved(dtype), device, max_tokens=max_tokens,
                allow_other_models=allow_other_models)


def handoff(models: Pair, mode: str = "mapped", mapper: str | Path | None = None, repair: str | None = None,
            shuffle_seed: int | None = None, batch_size: int = 16) -> Router:
    """The handoff of `mode` between `models` (a `pair`) through the map file `mapper` (mapped, shuffled), the
    target recomputing part of the cache first (`repair`, a `kv.repair` setting: `layers:1`,
    `sink:4+tokens:0.1:attention`); every argument checked before any weight loads."""
    if not isinstance(models, Pair):
        raise inputs.ParamTypeError(f"handoff() models: expected the pair pipeline.api.pair(target, source) makes, "
                                    f"got {type(models).__name__} {models!r:.60}")
    request = Transfer.of(API, mode=mode, mapper=None if mapper is None else str(mapper), repair=repair,
                         shuffle_seed=shuffle_seed, allow_other_models=models.allow_other_models)
    request.require_source(models.has_source, "one: pair(target, source)")
    request.check_geometry(models)
    return Router.of(models, request, inputs.at_least(batch_size, "handoff() batch_size", 1))


@dataclass
class HandedOff:
    """A prompt's handed-off cache: `cache` holds prompt[:-1] (None for a one-token prompt, which hands nothing
    off), `model` is the model that reads prompt[-1] after it, `route` says how the cache came (`kv.routes`).

    Under speculative prefill (`handoff(..., "speculative:0.1")`, share p = 0.1) the cache holds only the kept
    tokens, each at its own position: `next_token_logits` reads on at the true position, but transformers'
    `generate` numbers positions by the cache's length, so pass `position_ids` yourself there."""

    cache: object  # a transformers DynamicCache, or None
    model: object
    route: Route
    prompt: list[int]
    handoff: Handoff = field(repr=False)  # the handoff that built `layers`, and builds each read's own cache of them
    layers: Layers | None = field(repr=False)

    def next_token_logits(self):
        """The logits (V,) `model` gives for the token after the prompt, reading prompt[-1] after a fresh cache of
        prompt[:-1]: a read extends its own cache, never `cache`, so every read gives the same logits and `cache`
        still continues the whole prompt afterwards."""
        last = torch.tensor([self.prompt[-1:]], device=self.model.device)  # (1, 1)
        positions = torch.tensor([[len(self.prompt) - 1]], device=self.model.device)  # (1, 1)
        cache = self.handoff.decoder_cache(self.layers)
        with torch.no_grad():
            out = self.model(input_ids=last, cache=cache, position_ids=positions, use_cache=cache is not None)
        return out.logits[0, -1]  # (V,)


def handed_off(router: Router, prompt: Sequence[int], max_new_tokens: int = 1) -> HandedOff:
    """`prompt`'s cache as `router`'s handoff builds it (repaired where it repairs), as a fresh transformers cache.
    `prompt`: token ids (ints within the vocabulary; text or a float id is a TypeError). `max_new_tokens`: tokens you
    will decode after it (1: the next token's logits); with the prompt they must fit the models' positions (as
    generate's --max-new-tokens)."""
    if not isinstance(router, Router):
        raise inputs.ParamTypeError(f"handed_off() router: expected what pipeline.api.handoff(...) returns, got "
                                    f"{type(router).__name__} {router!r:.60}")
    # every model the router runs on a prompt: its decoding model and its source
    configs = [model.config for model in (router.handoff.decoder, router.handoff.source) if model is not None]
    prompt = inputs.token_ids(prompt, "handed_off() prompt", min(config.vocab_size for config in configs))
    if not prompt:
        raise ParamError("handed_off() prompt: empty; give at least one token")
    inputs.positions(len(prompt), inputs.at_least(max_new_tokens, "handed_off() max_new_tokens", 1),
                     "handed_off() prompt", positions(*configs))
    chosen = router.handoff
    layers = chosen.prefix_layers(torch.tensor([prompt[:-1]], dtype=torch.long))
    return HandedOff(chosen.decoder_cache(layers), chosen.decoder, router.route(prompt), prompt, chosen, layers)
