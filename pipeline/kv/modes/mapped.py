"""`mapped`: the source's cache through a fitted map (`kv.mapper`)."""
from __future__ import annotations

from pipeline.kv.modes.base import Mode, Reads


class Mapped(Mode):
    name = "mapped"
    reads = Reads(target=True, source=True, map=True, own=False)
    needs_map = True


MODE = Mapped()
