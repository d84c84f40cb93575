"""The handoff modes: how a handoff builds the prefix cache its decoding model reads; `MODES` is the registry.
Shapes: B rows of a right-padded prefix of P slots; every cache (B, H, P, D) per layer, rotated, in the decoder's dtype.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from pipeline.kv import entries
from pipeline.kv.geometry import kv_geometry
from pipeline.kv.kvcache import cache_to_layers
from pipeline.kv.lookahead import keep_positions, scored_prefill
from pipeline.kv.mapper import Mapper, map_cache
from pipeline.kv.recompute import RepairCount, repair_cache
from pipeline.kv.repair import Repair
from pipeline.kv.rope import RotarySpec, Rotation
from pipeline.kv.speculative import SpeculativeParams
from pipeline.store.devices import no_grad
from pipeline.store.lazy import lazy

torch = lazy("torch")

ClockHook = Callable[[str], None]  # told each part of a first step as it ends


class Reads(NamedTuple):
    target: bool  # the target decodes (False: the source alone, its own cache and its own predictions)
    source: bool  # the source model: its cache handed to the target, or the source alone
    map: bool  # a fitted map (`shuffled` also runs without one: the source's cache itself, permuted)
    own: bool  # the decoding model prefills the prompt itself: nothing is handed off, nothing to repair


class Built(NamedTuple):
    """A prefix cache as a mode built it (None for an empty prefix)."""

    layers: list | None  # the cache the decoding model reads
    # (B, K) the positions the decoding model computed itself in every layer by a choice (-1 pads), else None
    selected: object = None


@dataclass
class Inputs:
    decoder: object  # the model that decodes: the target, or the source itself in mode `source`
    source: object | None  # the source, where the mode reads it
    mapper: Mapper | None
    repair: Repair  # applied to every cache the decoder did not prefill, before its first step
    speculative: SpeculativeParams | None  # the look-ahead settings of `speculative` and a `source_attention` repair
    share: float | None  # the value of a mode that takes one (`speculative`'s p)
    shuffle_seed: int
    decoder_devices: list | None  # a decoder spread over devices: each layer's cache goes there
    decoder_spec: RotarySpec
    source_spec: RotarySpec | None  # where the source's cache is handed over
    repaired: RepairCount = field(default_factory=RepairCount)
    source_prefills: int = 0  # contexts the source prefilled, and the forwards that did it: counted so tests can
    source_forwards: int = 0  # check that shared contexts share a prefill and a batch shares a forward


class Prompt(NamedTuple):
    ids: torch.Tensor  # (B, P), P > 0, on the decoder's device
    lengths: torch.Tensor | None = None  # (B,) real lengths of right-padded rows (None: none is padded)
    mask: torch.Tensor | None = None  # (B, P) the real slots (None: all are)
    clock: ClockHook | None = None

    def real_lengths(self) -> torch.Tensor:
        """(B,) each row's real length, on the CPU."""
        batch, length = self.ids.shape
        return torch.full((batch,), length) if self.lengths is None else self.lengths.cpu()


@dataclass(frozen=True)
class Mode:
    name: str
    reads: Reads
    build: Callable[[Inputs, Prompt], Built]
    needs_map: bool = False  # refused without a fitted map (`shuffled` reads one where given)
    # its cache holds some of the prompt's tokens at their own positions: slot i is not position i, nothing is repaired
    sparse: bool = False
    parameter: str | None = None  # what the value after its name means (`speculative:0.1`); None: it takes none
    # why a pair of these models (`kv.contract.ModelCard`s) cannot use this mode, or None
    requirement: Callable[[object, object], str | None] = lambda source, target: None

    @property
    def hands_over(self) -> bool:
        """The source's cache is handed to the target (`direct`, `mapped`, `shuffled`)."""
        return self.reads.source and self.reads.target and not self.sparse


def tell(clock: ClockHook | None, part: str) -> None:
    if clock is not None:
        clock(part)


def own_prefill(model, prefix_ids: torch.Tensor, mask: torch.Tensor | None = None) -> list:
    """`model`'s own cache of prefix_ids (B, P): its decoder body only, no logits."""
    device = model.device
    return cache_to_layers(model.model(input_ids=prefix_ids.to(device),
                                       attention_mask=None if mask is None else mask.to(device), use_cache=True).cache)


@no_grad
def source_prefill(inputs: Inputs, prompt: Prompt, scored: bool) -> tuple[list, torch.Tensor | None]:
    """The source's cache of the prompt and, where `scored`, each slot's look-ahead score (B, P) from that forward."""
    inputs.source_prefills += prompt.ids.shape[0]
    inputs.source_forwards += 1
    if scored:
        return scored_prefill(inputs.source, prompt.ids, prompt.real_lengths(), prompt.mask, inputs.speculative,
                              prompt.clock)
    layers = own_prefill(inputs.source, prompt.ids, prompt.mask)
    tell(prompt.clock, "prefill")
    return layers, None


@no_grad
def rebuilt(inputs: Inputs, source_layers: list, mapper: Mapper | None = None, order: torch.Tensor | None = None
            ) -> list:
    """The source's cache re-encoded for the decoder: RoPE stripped, through `mapper` (None: unmapped), tokens in
    `order` (B, P) (None: as they are), the decoder's RoPE applied, in the decoder's dtype."""
    length, device = source_layers[0][0].shape[2], inputs.decoder.device
    positions = torch.arange(length, device=inputs.source.device)
    source_rotation = Rotation(inputs.source_spec, positions)
    # a map fitted on rotated keys (the length study's no-strip ablation) reads and writes them as cached
    rotated = mapper is not None and mapper.key_space == "rotated"
    content = [(k.float() if rotated else source_rotation.strip(k.float()), v.float())
               for k, v in source_layers]  # float32, content space (or rotated, for the ablation)
    target_rotation = Rotation(inputs.decoder_spec, positions.to(device))
    return [cache for _, cache in map_cache(mapper, content, target_rotation, inputs.decoder.dtype, device, order)]


def handed(inputs: Inputs, prompt: Prompt, mapped: list, scores: torch.Tensor | None) -> Built:
    """A cache the decoder did not make, repaired (timed into `repaired.log`); `scores` (B, P): the source's."""
    tell(prompt.clock, "map")
    repair, count = inputs.repair, inputs.repaired
    if repair.empty:
        return Built(mapped)
    start, before = time.perf_counter(), count.recomputed
    layers = repair_cache(inputs.decoder, mapped, prompt.ids, prompt.real_lengths(), repair, count,
                          inputs.decoder_devices, scores)
    count.log.append((count.recomputed - before, time.perf_counter() - start))
    tell(prompt.clock, "repair")
    return Built(layers, count.selected)


def own(inputs: Inputs, prompt: Prompt) -> Built:
    layers = own_prefill(inputs.decoder, prompt.ids, prompt.mask)
    tell(prompt.clock, "prefill")
    return Built(layers)


def zero(inputs: Inputs, prompt: Prompt) -> Built:
    geometry, (batch, length) = kv_geometry(inputs.decoder.config), prompt.ids.shape
    zeros = torch.zeros((batch, geometry["kv_heads"], length, geometry["head_dim"]), dtype=inputs.decoder.dtype,
                        device=inputs.decoder.device)  # (B, H, P, D)
    return handed(inputs, prompt, [(zeros, zeros) for _ in range(geometry["layers"])], None)


def direct(inputs: Inputs, prompt: Prompt) -> Built:
    source, scores = source_prefill(inputs, prompt, inputs.repair.reads_source)
    if inputs.source_spec == inputs.decoder_spec:  # one rotation: the cache only changes device and dtype
        device, dtype = inputs.decoder.device, inputs.decoder.dtype
        return handed(inputs, prompt, [(k.to(device, dtype), v.to(device, dtype)) for k, v in source], scores)
    return handed(inputs, prompt, rebuilt(inputs, source), scores)


def equal_geometry(source, target) -> str | None:
    if source.geometry == target.geometry:
        return None
    return (f"direct injection needs equal KV geometry, but source {source.name!r} has {source.geometry} and "
            f"target {target.name!r} has {target.geometry}; use a fitted mapper (transfer=mapped)")


def mapped(inputs: Inputs, prompt: Prompt) -> Built:
    source, scores = source_prefill(inputs, prompt, inputs.repair.reads_source)
    return handed(inputs, prompt, rebuilt(inputs, source, inputs.mapper), scores)


def shuffle_order(seed: int, length: int, lengths: torch.Tensor) -> torch.Tensor:
    """(B, T) token order of the shuffled null: row b's `lengths[b]` real tokens permuted as batch 1 would."""
    order = torch.arange(length).repeat(len(lengths), 1)  # (B, T): padding stays where it is
    for row, count in enumerate(lengths.tolist()):
        order[row, :count] = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    return order


def shuffled(inputs: Inputs, prompt: Prompt) -> Built:
    """What `mapped` would inject (without a map: the source's cache), each row's tokens permuted in content space."""
    source, scores = source_prefill(inputs, prompt, inputs.repair.reads_source)
    order = shuffle_order(inputs.shuffle_seed, prompt.ids.shape[1], prompt.real_lengths()).to(inputs.decoder.device)
    return handed(inputs, prompt, rebuilt(inputs, source, inputs.mapper, order), scores)


def speculative(inputs: Inputs, prompt: Prompt) -> Built:
    """Speculative prefill (SpecPrefill, arXiv 2502.02789): the target prefills only the top share p of the source's
    look-ahead scores, the sinks and the last m, at their own positions; p = 1 is the oracle's own call.

        prefix     c[0] c[1] c[2] c[3] c[4] c[5] c[6]         P = 7, sinks 1, last 2, p = 0.5
        kept       c[0]      c[2]      c[4] c[5] c[6]         K = 5 slots, positions 0 2 4 5 6
        step       c[7] at position 7 over the 5 slots
    """
    _, scores = source_prefill(inputs, prompt, scored=True)  # (B, P); the source's cache goes
    lengths = prompt.real_lengths()
    kept = keep_positions(scores, lengths, inputs.speculative, inputs.share)  # (B, K)
    if bool(((kept >= 0).sum(1) == lengths).all()):  # p = 1: every token kept
        layers = own_prefill(inputs.decoder, prompt.ids, prompt.mask)
    else:
        layers = kept_prefill(inputs.decoder, prompt.ids, kept)
    tell(prompt.clock, "sparse")  # the target's prefill of the kept tokens
    return Built(layers, kept)


def kept_prefill(target, prefix_ids: torch.Tensor, kept: torch.Tensor) -> list:
    """The target's cache (B, H, K, D) per layer of the tokens at positions `kept` (B, K) (ascending, -1 pads),
    each at its own position id, seeing the kept tokens before it."""
    real = kept >= 0  # (B, K)
    positions = kept.clamp(min=0)  # (B, K)
    tokens = prefix_ids.cpu().gather(1, positions)  # (B, K)
    device = target.device
    return cache_to_layers(target.model(input_ids=tokens.to(device), position_ids=positions.to(device),
                                        attention_mask=real.long().to(device), use_cache=True).cache)


MODES = entries.register(Mode, "modes", (  # the contract's order
    Mode("oracle", Reads(target=True, source=False, map=False, own=True), own),
    Mode("zero", Reads(target=True, source=False, map=False, own=False), zero),
    Mode("source", Reads(target=False, source=True, map=False, own=True), own),
    Mode("direct", Reads(target=True, source=True, map=False, own=False), direct, requirement=equal_geometry),
    Mode("mapped", Reads(target=True, source=True, map=True, own=False), mapped, needs_map=True),
    Mode("shuffled", Reads(target=True, source=True, map=True, own=False), shuffled),
    Mode("speculative", Reads(target=True, source=True, map=False, own=False), speculative, sparse=True,
         parameter="the share p in (0, 1] of the prompt's other positions the target prefills"),
))
SOURCE_MODES = tuple(name for name, mode in MODES.items() if mode.hands_over)  # the source's cache handed over
OWN_MODES = tuple(name for name, mode in MODES.items() if mode.reads.own)  # the decoding model's own prefill
MAPPER_MODES = tuple(name for name, mode in MODES.items() if mode.reads.map)  # `shuffled` also runs without a map
# the baselines (no map, no value): the oracle first (every other variant is compared with its outputs), then by name
BASELINES = tuple(sorted((name for name, mode in MODES.items() if not mode.reads.map and mode.parameter is None),
                         key=lambda mode: (mode != "oracle", mode)))


def split_mode(text: str) -> tuple[str, str | None]:
    """`NAME` or `NAME:VALUE` (`speculative:0.1`) -> (its name, the text of its value or None)."""
    name, colon, value = str(text).partition(":")
    return name, value if colon else None
