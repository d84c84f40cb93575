"""The method: RoPE strip/apply, cache <-> tensors, the FLOP model, source -> target maps, the handoff, and the
pair that builds every handoff on models loaded once."""
