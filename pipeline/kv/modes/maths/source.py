"""The maths of `source` (`kv/modes/source.py`): the source's own prefill, the source decoding."""
from __future__ import annotations

from pipeline.kv.modes import source
from pipeline.kv.modes.maths.base import Own


class SourceMaths(Own):
    declaration = source.MODE


MATHS = SourceMaths()
