"""The maths of `mapped` (`kv/modes/mapped.py`): the source's cache through the handoff's map."""
from __future__ import annotations

from pipeline.kv.modes import mapped
from pipeline.kv.modes.maths.base import FromSource


class MappedMaths(FromSource):
    declaration = mapped.MODE

    def to_target(self, handoff, source_layers, lengths):
        return handoff.rebuilt(source_layers, handoff.mapper)


MATHS = MappedMaths()
