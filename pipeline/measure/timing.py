"""Timing helpers shared by the stages: medians of repeated runs, a mapper's cost against the source's prefill."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from pipeline.kv.mapper import Mapper


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def time_against_prefill(mapper: Mapper, source_model, token_ids: list[int], content: list, repeats: int) -> float:
    """Mapper time / source prefill time over the same tokens (batch 1, this machine, median of repeats)."""
    ids = torch.tensor(token_ids, dtype=torch.long)[None]  # (1, T)
    positions = torch.arange(ids.shape[1])
    prefill_s = median_seconds(lambda: source_model.model(input_ids=ids, use_cache=True), repeats)
    map_s = median_seconds(lambda: mapper.apply(content, positions), repeats)
    return map_s / prefill_s
