"""Measuring a variant: paired statistics, lm-eval tasks on local files, agreement with the oracle, latency."""
