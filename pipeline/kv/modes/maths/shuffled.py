"""The maths of `shuffled` (`kv/modes/shuffled.py`): what `mapped` would inject (or the source's cache itself), each
row's tokens permuted by a seeded permutation in content space, before the target's RoPE."""
from __future__ import annotations

from pipeline.kv.modes import shuffled
from pipeline.kv.modes.maths.base import FromSource
from pipeline.store.lazy import lazy

torch = lazy("torch")


def shuffle_order(seed: int, length: int, lengths: torch.Tensor | None, batch: int) -> torch.Tensor:
    """(B, T) token order of the shuffled null: each row's real tokens permuted by the same seeded permutation
    batch 1 would draw for its length; padding stays in place."""
    real = lengths.tolist() if lengths is not None else [length] * batch
    order = torch.arange(length).repeat(batch, 1)  # (B, T)
    for row, count in enumerate(real):
        order[row, :count] = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    return order


class ShuffledMaths(FromSource):
    declaration = shuffled.MODE

    def to_target(self, handoff, source_layers, lengths):
        batch, _, length, _ = source_layers[0][0].shape  # (B, H_s, P, D_s)
        order = shuffle_order(handoff.shuffle_seed, length, lengths, batch).to(handoff.device)
        return handoff.rebuilt(source_layers, handoff.mapper, order)


MATHS = ShuffledMaths()
