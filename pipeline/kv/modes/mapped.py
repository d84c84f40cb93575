"""`mapped`: the source's cache through a fitted map (`kv.mapper`)."""
from __future__ import annotations

from pipeline.kv.modes.base import FromSource, Reads


class Mapped(FromSource):
    name = "mapped"
    reads = Reads(target=True, source=True, map=True, own=False)
    needs_map = True

    def to_target(self, handoff, source_layers, lengths):
        return handoff.rebuilt(source_layers, handoff.mapper)


MODE = Mapped()
