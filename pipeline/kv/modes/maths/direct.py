"""The maths of `direct` (`kv/modes/direct.py`): the source's cache unmapped, re-encoded for the target's RoPE."""
from __future__ import annotations

from pipeline.kv.modes import direct
from pipeline.kv.modes.maths.base import FromSource


class DirectMaths(FromSource):
    declaration = direct.MODE

    def to_target(self, handoff, source_layers, lengths):
        if handoff.source_spec == handoff.decoder_spec:  # one rotation: the cache only changes device and dtype
            dtype = handoff.decoder.dtype
            return [(k.to(handoff.device, dtype), v.to(handoff.device, dtype)) for k, v in source_layers]
        return handoff.rebuilt(source_layers)


MATHS = DirectMaths()
