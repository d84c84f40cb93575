"""`speculative`: speculative prefill (SpecPrefill, arXiv 2502.02789), a token-skipping rival at the handoff's cost.
The source prefills the prompt and its look-ahead attention scores every position (`kv.lookahead`); the target
prefills only the top share p of them, the sinks and the last m, at their own positions, and decodes from that sparse
cache. Written `speculative:P`; p = 1 is the oracle. Needs no map, so it stays defined at unequal geometry."""
from __future__ import annotations

from pipeline.kv.modes.base import Mode, Reads


class Speculative(Mode):
    name = "speculative"
    reads = Reads(target=True, source=True, map=False, own=False)
    sparse = True
    parameter = "the share p in (0, 1] of the prompt's other positions the target prefills"


MODE = Speculative()
