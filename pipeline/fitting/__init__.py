"""Fitting the maps: ridge from streamed moments, the MLP trainer, layer probes, every candidate per layer."""
