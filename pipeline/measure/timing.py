"""Timing helpers shared by the stages: medians of repeated runs, a mapper's cost against the source's prefill."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from pipeline.kv.mapper import Mapper


def median_seconds(fn: Callable[[], object], repeats: int, device: str | torch.device) -> float:
    """Median wall time of fn(); on a GPU the queued kernels are waited for before the clock is read."""
    synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def time_against_prefill(mapper: Mapper, source_model, token_ids: list[int], content: list, repeats: int) -> float:
    """Mapper time / source prefill time over the same tokens (batch 1, this machine, median of repeats)."""
    device = source_model.device
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)[None]  # (1, T)
    positions = torch.arange(ids.shape[1], device=device)
    prefill_s = median_seconds(lambda: source_model.model(input_ids=ids, use_cache=True), repeats, device)
    map_s = median_seconds(lambda: mapper.apply(content, positions), repeats, device)
    return map_s / prefill_s
