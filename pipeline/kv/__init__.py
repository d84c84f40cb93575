"""The method: RoPE strip/apply, cache <-> tensors, the FLOP model, source -> target maps, the handoff."""
