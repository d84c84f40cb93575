"""What a handoff mode's maths is: its hook `prefix`, which builds the prefix cache for the mode declared in
`kv/modes/<name>.py`; `kv.handoff.Handoff.built` calls it and nothing else branches on a mode's name. Two shapes
cover six of the seven:

    Own      the decoding model prefills the prompt itself (oracle, source): nothing handed off, nothing repaired
    Handed   a cache the decoding model did not make (zero, direct, mapped, shuffled), then the handoff's repair;
             `FromSource` is the source's own prefill brought into the target's space (`to_target`)

and `speculative` fills in `prefix` itself: the target's prefill of the positions the source's scores keep.

Shapes: B rows of a right-padded prefix of P slots; every cache (B, H, P, D) per layer, rotated, in the decoder's dtype.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, NamedTuple

from pipeline.kv.entries import Maths
from pipeline.kv.modes.base import Mode

ClockHook = Callable[[str], None]  # told each part of a first step as it ends (`measure.timing.Stopwatch`)


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


class ModeMaths(Maths, ABC):
    """The interface of a mode's maths; a maths module defines one subclass (of `Own`, `Handed` or `FromSource`),
    naming its declaration (`declaration`, the module's `MODE`), and one instance, `MATHS`."""

    declaration: Mode | None = None

    @abstractmethod
    def prefix(self, handoff, prefix_ids, lengths, mask, clock: ClockHook | None, prefilled: list | None) -> Built:
        """The prefix cache of prefix_ids (B, P) for `handoff` (a `kv.handoff.Handoff`), P > 0; `lengths` (B,) and
        `mask` (B, P) mark right-padded rows (None: none is); `clock(part)` is told as each part ends
        (`Handoff.first_step`); `prefilled`: the prefill's cache, made already by a handoff of the same model."""


class Own(ModeMaths):
    """The decoding model's own prefill of the prompt."""

    def prefix(self, handoff, prefix_ids, lengths, mask, clock, prefilled):
        own = prefilled if prefilled is not None else handoff.own_prefill(prefix_ids, mask)
        tell(clock, "prefill")
        return Built(None, None, own)


class Handed(ModeMaths):
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
