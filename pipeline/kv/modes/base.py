"""What a handoff mode is: the one interface every mode module fills in, its declaration.

A mode says how a handoff builds the prefix cache its decoding model reads. It is two modules (the contract's
`pair_contract` also names each mode once, to say which the pair's geometry allows):

    kv/modes/<name>.py        its declaration: its name, what it reads (`Reads`, the architecture contract's
                              declaration, `kv.contract`), whether it is refused without a fitted map, and how the
                              report names it
    kv/modes/maths/<name>.py  its maths: its prefix hook (`maths.base.ModeMaths.prefix`), the torch side of building
                              the cache, which `kv.handoff.Handoff.built` calls

The contract, the requests' checks and the report read the declarations alone; only the handoff imports the maths.
"""
from __future__ import annotations

from typing import NamedTuple


class Reads(NamedTuple):
    """What a handoff mode reads: the mode's one declaration is its entry's `reads`."""

    target: bool  # the target decodes (False: the source alone, its own cache and its own predictions)
    source: bool  # the source model: its cache handed to the target, or the source alone
    map: bool  # a fitted map (`shuffled` also runs without one: the source's cache itself, permuted)
    own: bool  # the decoding model prefills the prompt itself: nothing is handed off, nothing to repair or gate


MAPS_ROW = 100  # the report's rows of maps (V0's best per k, the selected, the repaired) stand here


class Mode:
    """The declaration of a mode; a mode module defines one subclass and one instance, `MODE`."""

    name: str = ""
    reads: Reads
    needs_map: bool = False  # refused without a fitted map (`shuffled` reads one where given)
    label: str = ""  # the report's row name
    row: int | None = None  # its place in the report's table: below MAPS_ROW before the maps, else after them
    rival: str | None = None  # how the report's reading names it beside a mapped transfer (None: it does not)
    reading: int | None = None  # its place among the rivals the reading compares a mapped transfer with
    # its cache holds some of the prompt's tokens, each at its own position (`speculative`): slot i is not position i,
    # so every read after it is told the positions, and nothing is handed over or repaired
    sparse: bool = False
    parameter: str | None = None  # what the value after its name means (`speculative:0.1`); None: it takes none

    @property
    def hands_over(self) -> bool:
        """The source's cache is handed to the target (`direct`, `mapped`, `shuffled`)."""
        return self.reads.source and self.reads.target and not self.sparse

    def refusal(self, has_source: bool, has_mapper: bool) -> str | None:
        """Why a handoff of this mode cannot be built with or without a source model and a mapper, or None."""
        if self.reads.source and self.reads.target and not has_source:
            return f"transfer mode {self.name!r} needs a source model"
        if self.needs_map and not has_mapper:
            return f"transfer mode {self.name!r} needs a mapper"
        return None
