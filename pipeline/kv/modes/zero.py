"""`zero`: the null control of an all-zero cache of the target's shape."""
from __future__ import annotations

from pipeline.kv.modes.base import Mode, Reads


class Zero(Mode):
    name = "zero"
    reads = Reads(target=True, source=False, map=False, own=False)
    label = "Null control: zero cache"
    row = 102
    rival = "the zero-cache null"
    reading = 1


MODE = Zero()
