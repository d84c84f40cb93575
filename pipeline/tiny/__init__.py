"""The embedded tiny world: its tokenizer, its generator, and the training of the tiny pair."""
