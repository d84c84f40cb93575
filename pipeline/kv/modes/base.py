"""What a handoff mode is: the one interface every mode module fills in.

A mode says how a handoff builds the prefix cache its decoding model reads: its hook `prefix`, which
`kv.handoff.Handoff.built` calls and nothing else branches on a mode's name for. Its module (`kv/modes/<name>.py`)
says everything the pipeline needs of it: its name, what it reads (`Reads`, the architecture contract's declaration,
`kv.contract`), whether it is refused without a fitted map, and how the report names it. Two shapes cover the six:

    Own      the decoding model prefills the prompt itself (oracle, source): nothing handed off, nothing repaired
    Handed   a cache the decoding model did not make (zero, direct, mapped, shuffled), then the handoff's repair;
             `FromSource` is the source's own prefill brought into the target's space (`to_target`)

Shapes: B rows of a right-padded prefix of P slots; every cache (B, H, P, D) per layer, rotated, in the decoder's dtype.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, NamedTuple

ClockHook = Callable[[str], None]  # told each part of a first step as it ends (`measure.timing.Stopwatch`)


class Reads(NamedTuple):
    """What a handoff mode reads: the mode's one declaration is its entry's `reads`."""

    target: bool  # the target decodes (False: the source alone, its own cache and its own predictions)
    source: bool  # the source model: its cache handed to the target, or the source alone
    map: bool  # a fitted map (`shuffled` also runs without one: the source's cache itself, permuted)
    own: bool  # the decoding model prefills the prompt itself: nothing is handed off, nothing to repair or gate


class Built(NamedTuple):
    """A prefix cache as a mode's `prefix` made it; each part None where the mode has none (an empty prefix: all)."""

    source: list | None  # the source's own cache (a source mode)
    mapped: list | None  # the cache handed to the target, before the repair (a source mode, `zero`)
    layers: list | None  # the cache the decoding model reads


def tell(clock: ClockHook | None, part: str) -> None:
    if clock is not None:
        clock(part)


MAPS_ROW = 100  # the report's rows of maps (V0's best per k, the selected, the repaired) stand here


class Mode(ABC):
    """The interface of a mode; a mode module defines one subclass and one instance, `MODE`."""

    name: str = ""
    reads: Reads
    needs_map: bool = False  # refused without a fitted map (`shuffled` reads one where given)
    label: str = ""  # the report's row name
    row: int | None = None  # its place in the report's table: below MAPS_ROW before the maps, else after them
    rival: str | None = None  # how the report's reading names it beside a mapped transfer (None: it does not)
    reading: int | None = None  # its place among the rivals the reading compares a mapped transfer with

    @property
    def hands_over(self) -> bool:
        """The source's cache is handed to the target (`direct`, `mapped`, `shuffled`)."""
        return self.reads.source and self.reads.target

    def refusal(self, has_source: bool, has_mapper: bool) -> str | None:
        """Why a handoff of this mode cannot be built with or without a source model and a mapper, or None."""
        if self.hands_over and not has_source:
            return f"transfer mode {self.name!r} needs a source model"
        if self.needs_map and not has_mapper:
            return f"transfer mode {self.name!r} needs a mapper"
        return None

    @abstractmethod
    def prefix(self, handoff, prefix_ids, lengths, mask, clock: ClockHook | None, prefilled: list | None) -> Built:
        """The prefix cache of prefix_ids (B, P) for `handoff` (a `kv.handoff.Handoff`), P > 0; `lengths` (B,) and
        `mask` (B, P) mark right-padded rows (None: none is); `clock(part)` is told as `prefill` and `map` (with the
        repair) end; `prefilled`: the prefill's cache, made already by a handoff of the same model."""


class Own(Mode):
    """The decoding model's own prefill of the prompt."""

    def prefix(self, handoff, prefix_ids, lengths, mask, clock, prefilled):
        own = prefilled if prefilled is not None else handoff.own_prefill(prefix_ids, mask)
        tell(clock, "prefill")
        return Built(None, None, own)


class Handed(Mode):
    """A cache the decoding model did not make, handed to it and then repaired (`kv.repair`)."""

    def prefix(self, handoff, prefix_ids, lengths, mask, clock, prefilled):
        source, mapped = self.handed(handoff, prefix_ids, lengths, mask, clock, prefilled)
        layers = handoff.repaired_layers(mapped, prefix_ids, lengths)
        tell(clock, "map")
        return Built(source, mapped, layers)

    @abstractmethod
    def handed(self, handoff, prefix_ids, lengths, mask, clock, prefilled) -> tuple[list | None, list]:
        """(the source's own cache or None, the cache handed to the target before the repair)."""


class FromSource(Handed):
    """The source's own prefill, brought into the target's space."""

    def handed(self, handoff, prefix_ids, lengths, mask, clock, prefilled):
        source = prefilled if prefilled is not None else handoff.source_prefill(prefix_ids, mask)
        tell(clock, "prefill")
        return source, handoff.to_target(source, lengths)

    @abstractmethod
    def to_target(self, handoff, source_layers: list, lengths) -> list:
        """The source's cache (B, H_s, P, D_s) per layer -> the target's (rotated, target dtype); `lengths` (B,)
        the real lengths of right-padded rows (None: none is padded)."""
