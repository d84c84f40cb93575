"""The handoff modes: how a handoff builds the prefix cache its decoding model reads. One class holds a mode's name,
what it reads, whether it needs a fitted map, and its prefix hook (the report's words for it are the report's,
`studies.variants`); `MODES` is the one list.
Shapes: B rows of a right-padded prefix of P slots; every cache (B, H, P, D) per layer, rotated, in the decoder's dtype.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, NamedTuple

from pipeline.kv import entries
from pipeline.kv.kvcache import cache_to_layers
from pipeline.kv.lookahead import keep_positions
from pipeline.store.lazy import lazy

torch = lazy("torch")

ClockHook = Callable[[str], None]  # told each part of a first step as it ends (`measure.timing.Stopwatch`)


class Reads(NamedTuple):
    """What a handoff mode reads."""

    target: bool  # the target decodes (False: the source alone, its own cache and its own predictions)
    source: bool  # the source model: its cache handed to the target, or the source alone
    map: bool  # a fitted map (`shuffled` also runs without one: the source's cache itself, permuted)
    own: bool  # the decoding model prefills the prompt itself: nothing is handed off, nothing to repair or gate


class Built(NamedTuple):
    """A prefix cache as a mode's `prefix` made it; each part None where the mode has none (an empty prefix: all)."""

    source: list | None  # the source's own cache (a source mode)
    mapped: list | None  # the cache handed to the target, before the repair (a source mode, `zero`)
    layers: list | None  # the cache the decoding model reads
    # (B, K) the positions the decoding model computed itself in every layer by a choice (-1 pads): the tokens a
    # sparse mode kept, a repair's sink and chosen tokens; None where nothing was chosen (its own prefill, a bare map)
    selected: object = None


def tell(clock: ClockHook | None, part: str) -> None:
    if clock is not None:
        clock(part)


class Mode(ABC):
    """A mode: a subclass names it, says what it reads and builds the prefix cache (`prefix`, abstract)."""

    name: str = ""
    reads: Reads
    needs_map: bool = False  # refused without a fitted map (`shuffled` reads one where given)
    # its cache holds some of the prompt's tokens, each at its own position (`speculative`): slot i is not position i,
    # so every read after it is told the positions, and nothing is handed over or repaired
    sparse: bool = False
    parameter: str | None = None  # what the value after its name means (`speculative:0.1`); None: it takes none

    @property
    def hands_over(self) -> bool:
        """The source's cache is handed to the target (`direct`, `mapped`, `shuffled`)."""
        return self.reads.source and self.reads.target and not self.sparse

    def requirement(self, source, target) -> str | None:
        """Why a pair of these models (`kv.contract.ModelCard`: name, geometry) cannot use this mode, or None."""
        return None

    @abstractmethod
    def prefix(self, handoff, prefix_ids, lengths, mask, clock: ClockHook | None, prefilled: list | None) -> Built:
        """The prefix cache of prefix_ids (B, P) for `handoff` (a `kv.handoff.Handoff`), P > 0; `lengths` (B,) and
        `mask` (B, P) mark right-padded rows (None: none is); `clock(part)` is told as each part ends
        (`Handoff.first_step`); `prefilled`: the prefill's cache, made already by a handoff of the same model."""


class Own(Mode):
    """The decoding model's own prefill of the prompt: nothing handed off, nothing repaired."""

    def prefix(self, handoff, prefix_ids, lengths, mask, clock, prefilled):
        own = prefilled if prefilled is not None else handoff.own_prefill(prefix_ids, mask)
        tell(clock, "prefill")
        return Built(None, None, own)


class Handed(Mode):
    """A cache the decoding model did not make, handed to it and then repaired (`kv.recompute`)."""

    def prefix(self, handoff, prefix_ids, lengths, mask, clock, prefilled):
        source, mapped, scores = self.handed(handoff, prefix_ids, lengths, mask, clock, prefilled)
        tell(clock, "map")
        layers = handoff.repaired_layers(mapped, prefix_ids, lengths, scores)
        if not handoff.repair.empty:
            tell(clock, "repair")
        return Built(source, mapped, layers, None if handoff.repair.empty else handoff.repaired.selected)

    @abstractmethod
    def handed(self, handoff, prefix_ids, lengths, mask, clock, prefilled) -> tuple[list | None, list, object]:
        """(the source's own cache or None, the cache handed to the target before the repair, the source's look-ahead
        scores (B, P) where the repair reads them (`kv.lookahead`), else None)."""


class FromSource(Handed):
    """The source's own prefill, brought into the target's space; where the repair's policy reads the source's
    look-ahead scores, they come from the same forward (a cache prefilled already is then not reused)."""

    def handed(self, handoff, prefix_ids, lengths, mask, clock, prefilled):
        scores = None
        if handoff.repair.reads_source:
            source, scores = handoff.scored_source_prefill(prefix_ids, lengths, mask, clock)
        else:
            source = prefilled if prefilled is not None else handoff.source_prefill(prefix_ids, mask)
            tell(clock, "prefill")
        return source, handoff.to_target(source, lengths), scores

    @abstractmethod
    def to_target(self, handoff, source_layers: list, lengths) -> list:
        """The source's cache (B, H_s, P, D_s) per layer -> the target's (rotated, target dtype); `lengths` (B,)
        the real lengths of right-padded rows (None: none is padded)."""


class Oracle(Own):
    """The target's own prefill of the prompt, the upper bound every other mode is compared with."""

    name = "oracle"
    reads = Reads(target=True, source=False, map=False, own=True)


class Zero(Handed):
    """The null control of an all-zero cache of the target's shape."""

    name = "zero"
    reads = Reads(target=True, source=False, map=False, own=False)

    def handed(self, handoff, prefix_ids, lengths, mask, clock, prefilled):
        geometry, (batch, length) = handoff.decoder_geometry, prefix_ids.shape
        shape = (batch, geometry["kv_heads"], length, geometry["head_dim"])
        zeros = torch.zeros(shape, dtype=handoff.decoder.dtype, device=handoff.device)  # (B, H, P, D)
        return None, [(zeros, zeros) for _ in range(geometry["layers"])], None


class Source(Own):
    """The source model alone: its own prefill and predictions (the handoff's decoding model is the source)."""

    name = "source"
    reads = Reads(target=False, source=True, map=False, own=True)


class Direct(FromSource):
    """The source's cache unmapped, re-encoded for the target's RoPE (needs equal KV geometry)."""

    name = "direct"
    reads = Reads(target=True, source=True, map=False, own=False)

    def requirement(self, source, target) -> str | None:
        if source.geometry == target.geometry:
            return None
        return (f"direct injection needs equal KV geometry, but source {source.name!r} has {source.geometry} and "
                f"target {target.name!r} has {target.geometry}; use a fitted mapper (transfer=mapped)")

    def to_target(self, handoff, source_layers, lengths):
        if handoff.source_spec == handoff.decoder_spec:  # one rotation: the cache only changes device and dtype
            dtype = handoff.decoder.dtype
            return [(k.to(handoff.device, dtype), v.to(handoff.device, dtype)) for k, v in source_layers]
        return handoff.rebuilt(source_layers)


class Mapped(FromSource):
    """The source's cache through a fitted map (`kv.mapper`)."""

    name = "mapped"
    reads = Reads(target=True, source=True, map=True, own=False)
    needs_map = True

    def to_target(self, handoff, source_layers, lengths):
        return handoff.rebuilt(source_layers, handoff.mapper)


def shuffle_order(seed: int, length: int, lengths: torch.Tensor | None, batch: int) -> torch.Tensor:
    """(B, T) token order of the shuffled null: each row's real tokens permuted by the same seeded permutation
    batch 1 would draw for its length; padding stays in place."""
    real = lengths.tolist() if lengths is not None else [length] * batch
    order = torch.arange(length).repeat(batch, 1)  # (B, T)
    for row, count in enumerate(real):
        order[row, :count] = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    return order


class Shuffled(FromSource):
    """The null control: what `mapped` would inject (or, without a map, the source's cache itself) with each row's
    token order permuted by a seeded permutation in content space, before the target's RoPE."""

    name = "shuffled"
    reads = Reads(target=True, source=True, map=True, own=False)

    def to_target(self, handoff, source_layers, lengths):
        batch, _, length, _ = source_layers[0][0].shape  # (B, H_s, P, D_s)
        order = shuffle_order(handoff.shuffle_seed, length, lengths, batch).to(handoff.device)
        return handoff.rebuilt(source_layers, handoff.mapper, order)


class Speculative(Mode):
    """Speculative prefill (SpecPrefill, arXiv 2502.02789), a token-skipping rival at the handoff's cost: the source
    prefills the prompt and its look-ahead attention scores every position (`kv.lookahead`); the target prefills only
    the top share p of them, the sinks and the last m, at their own positions, and decodes from that sparse cache.
    Written `speculative:P`; p = 1 is the oracle (the oracle's own call). Needs no map: defined at unequal geometry.

        prefix     c[0] c[1] c[2] c[3] c[4] c[5] c[6]         P = 7, sinks 1, last 2, p = 0.5
        kept       c[0]      c[2]      c[4] c[5] c[6]         K = 5 slots, positions 0 2 4 5 6
        step       c[7] at position 7 over the 5 slots
    """

    name = "speculative"
    reads = Reads(target=True, source=True, map=False, own=False)
    sparse = True
    parameter = "the share p in (0, 1] of the prompt's other positions the target prefills"

    def prefix(self, handoff, prefix_ids, lengths, mask, clock, prefilled):
        lengths = torch.full((prefix_ids.shape[0],), prefix_ids.shape[1]) if lengths is None else lengths.cpu()
        _, scores = handoff.scored_source_prefill(prefix_ids, lengths, mask, clock)  # (B, P); the source's cache goes
        kept = keep_positions(scores, lengths, handoff.speculative, handoff.share)  # (B, K)
        if bool((handoff.slots(lengths) == lengths).all()):
            layers = handoff.own_prefill(prefix_ids, mask)
        else:
            layers = kept_prefill(handoff.decoder, prefix_ids, kept)
        tell(clock, "sparse")  # the target's prefill of the kept tokens
        return Built(None, None, layers, kept)


def kept_prefill(target, prefix_ids: torch.Tensor, kept: torch.Tensor) -> list:
    """The target's cache (B, H, K, D) per layer of the tokens at positions `kept` (B, K) (ascending, -1 pads the
    rows' ends), each at its own position id, each seeing the kept tokens before it."""
    real = kept >= 0  # (B, K)
    positions = kept.clamp(min=0)  # (B, K)
    tokens = prefix_ids.cpu().gather(1, positions)  # (B, K)
    device = target.device
    return cache_to_layers(target.model(input_ids=tokens.to(device), position_ids=positions.to(device),
                                        attention_mask=real.long().to(device), use_cache=True).cache)


def register(*modes: Mode) -> dict[str, Mode]:
    return entries.register(Mode, "modes", modes)


MODES = register(Oracle(), Zero(), Source(), Direct(), Mapped(), Shuffled(), Speculative())  # the contract's order
SOURCE_MODES = tuple(name for name, mode in MODES.items() if mode.hands_over)  # the source's cache handed over
OWN_MODES = tuple(name for name, mode in MODES.items() if mode.reads.own)  # the decoding model's own prefill
MAPPER_MODES = tuple(name for name, mode in MODES.items() if mode.reads.map)  # `shuffled` also runs without a map
# the baselines (no map, no value): the oracle first (every other variant is compared with its outputs), then by name
BASELINES = tuple(sorted((name for name, mode in MODES.items() if not mode.reads.map and mode.parameter is None),
                         key=lambda mode: (mode != "oracle", mode)))


def split_mode(text: str) -> tuple[str, str | None]:
    """A mode as a request writes it, `NAME` or `NAME:VALUE` (`speculative:0.1`, as a repair writes `tokens:0.1`):
    (its name, the text of its value or None)."""
    name, colon, value = str(text).partition(":")
    return name, value if colon else None

