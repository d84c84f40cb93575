"""`direct`: the source's cache unmapped, re-encoded for the target's RoPE (needs equal KV geometry)."""
from __future__ import annotations

from pipeline.kv.modes.base import FromSource, Reads


class Direct(FromSource):
    name = "direct"
    reads = Reads(target=True, source=True, map=False, own=False)
    label = "Direct source-cache injection"
    row = 1  # V0's second row
    rival = "direct injection"
    reading = 3

    def to_target(self, handoff, source_layers, lengths):
        if handoff.source_spec == handoff.decoder_spec:  # one rotation: the cache only changes device and dtype
            dtype = handoff.decoder.dtype
            return [(k.to(handoff.device, dtype), v.to(handoff.device, dtype)) for k, v in source_layers]
        return handoff.rebuilt(source_layers)


MODE = Direct()
