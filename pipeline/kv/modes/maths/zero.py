"""The maths of `zero` (`kv/modes/zero.py`): an all-zero cache of the target's shape."""
from __future__ import annotations

from pipeline.kv.modes import zero
from pipeline.kv.modes.maths.base import Handed
from pipeline.store.lazy import lazy

torch = lazy("torch")


class ZeroMaths(Handed):
    declaration = zero.MODE

    def handed(self, handoff, prefix_ids, lengths, mask, clock, prefilled):
        geometry, (batch, length) = handoff.decoder_geometry, prefix_ids.shape
        shape = (batch, geometry["kv_heads"], length, geometry["head_dim"])
        zeros = torch.zeros(shape, dtype=handoff.decoder.dtype, device=handoff.device)  # (B, H, P, D)
        return None, [(zeros, zeros) for _ in range(geometry["layers"])], None


MATHS = ZeroMaths()
