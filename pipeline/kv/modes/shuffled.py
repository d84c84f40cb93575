"""`shuffled`: the null control of what `mapped` would inject (or, without a map, the source's cache itself) with
each row's token order permuted by a seeded permutation in content space, before the target's RoPE."""
from __future__ import annotations

from pipeline.kv.modes.base import Mode, Reads


class Shuffled(Mode):
    name = "shuffled"
    reads = Reads(target=True, source=True, map=True, own=False)
    label = "Null control: shuffled cache"
    row = 103
    rival = "the shuffled-cache null"
    reading = 2


MODE = Shuffled()
