"""`source`: the source model alone, its own prefill and its own predictions (the handoff's decoding model is the
source)."""
from __future__ import annotations

from pipeline.kv.modes.base import Mode, Reads


class Source(Mode):
    name = "source"
    reads = Reads(target=False, source=True, map=False, own=True)
    label = "Source model alone"
    row = 101
    rival = "the source model alone"
    reading = 0


MODE = Source()
