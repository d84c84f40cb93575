"""`oracle`: the target's own prefill of the prompt, the upper bound every other mode is compared with."""
from __future__ import annotations

from pipeline.kv.modes.base import Mode, Reads


class Oracle(Mode):
    name = "oracle"
    reads = Reads(target=True, source=False, map=False, own=True)
    label = "Target full-prefill oracle"
    row = 0


MODE = Oracle()
