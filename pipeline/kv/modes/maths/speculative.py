"""The maths of `speculative` (`kv/modes/speculative.py`): the source's prefill scores the prefix's positions
(`kv.lookahead`), the target prefills the ones kept at their own position ids.

    prefix     c[0] c[1] c[2] c[3] c[4] c[5] c[6]         P = 7, sinks 1, last 2, p = 0.5
    kept       c[0]      c[2]      c[4] c[5] c[6]         K = 5 slots, positions 0 2 4 5 6
    step       c[7] at position 7 over the 5 slots

Where every row keeps every position (p = 1) the target's prefill is the oracle's own call.
"""
from __future__ import annotations

from pipeline.kv.kvcache import cache_to_layers
from pipeline.kv.lookahead import keep_positions
from pipeline.kv.modes import speculative
from pipeline.kv.modes.maths.base import Built, ModeMaths, tell
from pipeline.store.lazy import lazy

torch = lazy("torch")


class SpeculativeMaths(ModeMaths):
    declaration = speculative.MODE

    def prefix(self, handoff, prefix_ids, lengths, mask, clock, prefilled):
        lengths = torch.full((prefix_ids.shape[0],), prefix_ids.shape[1]) if lengths is None else lengths.cpu()
        _, scores = handoff.scored_source_prefill(prefix_ids, lengths, mask, clock)  # (B, P); the source's cache goes
        kept = keep_positions(scores, lengths, handoff.speculative, handoff.share)  # (B, K)
        if bool((handoff.slots(lengths) == lengths).all()):
            layers = handoff.own_prefill(prefix_ids, mask)
        else:
            layers = kept_prefill(handoff.decoder, prefix_ids, kept)
        tell(clock, "sparse")  # the target's prefill of the kept tokens
        return Built(None, None, layers, kept)


def kept_prefill(target, prefix_ids: torch.Tensor, kept: torch.Tensor) -> list:
    """The target's cache (B, H, K, D) per layer of the tokens at positions `kept` (B, K) (ascending, -1 pads the
    rows' ends), each at its own position id, each seeing the kept tokens before it."""
    real = kept >= 0  # (B, K)
    positions = kept.clamp(min=0)  # (B, K)
    tokens = prefix_ids.cpu().gather(1, positions)  # (B, K)
    device = target.device
    return cache_to_layers(target.model(input_ids=tokens.to(device), position_ids=positions.to(device),
                                        attention_mask=real.long().to(device), use_cache=True).cache)


MATHS = SpeculativeMaths()
