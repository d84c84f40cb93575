"""`direct`: the source's cache unmapped, re-encoded for the target's RoPE (needs equal KV geometry)."""
from __future__ import annotations

from pipeline.kv.modes.base import Mode, Reads


class Direct(Mode):
    name = "direct"
    reads = Reads(target=True, source=True, map=False, own=False)
    label = "Direct source-cache injection"
    row = 1  # V0's second row
    rival = "direct injection"
    reading = 3


MODE = Direct()
