"""The maths of `oracle` (`kv/modes/oracle.py`): the target's own prefill."""
from __future__ import annotations

from pipeline.kv.modes import oracle
from pipeline.kv.modes.maths.base import Own


class OracleMaths(Own):
    declaration = oracle.MODE


MATHS = OracleMaths()
