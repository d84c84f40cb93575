"""`zero`: the null control of an all-zero cache of the target's shape."""
from __future__ import annotations

from pipeline.kv.modes.base import Handed, Reads
from pipeline.store.lazy import lazy

torch = lazy("torch")


class Zero(Handed):
    name = "zero"
    reads = Reads(target=True, source=False, map=False, own=False)
    label = "Null control: zero cache"
    row = 102
    rival = "the zero-cache null"
    reading = 1

    def handed(self, handoff, prefix_ids, lengths, mask, clock, prefilled):
        geometry, (batch, length) = handoff.decoder_geometry, prefix_ids.shape
        shape = (batch, geometry["kv_heads"], length, geometry["head_dim"])
        zeros = torch.zeros(shape, dtype=handoff.decoder.dtype, device=handoff.device)  # (B, H, P, D)
        return None, [(zeros, zeros) for _ in range(geometry["layers"])]


MODE = Zero()
