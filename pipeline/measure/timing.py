"""Timing: medians of repeated runs, a mapper's cost against the source's prefill, and a first step's `Stopwatch`."""
from __future__ import annotations

import statistics
import time
from typing import Callable

from pipeline.kv.mapper import Mapper
from pipeline.store.devices import no_grad
from pipeline.store.lazy import lazy

torch = lazy("torch")


def read_clock(device: torch.device) -> int:
    """Nanoseconds now, once the device's queued kernels are done (a CUDA synchronize on a GPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter_ns()


class Stopwatch:
    """Synchronized readings of one request's parts: made at the start, called with a part's name as the part ends
    (a `kv.handoff.ClockHook`); a part told twice adds up."""

    def __init__(self, device: torch.device):
        self.device = device
        self.marks: list[tuple[str, int]] = [("start", read_clock(device))]

    def __call__(self, part: str) -> None:
        self.marks.append((part, read_clock(self.device)))

    def parts_ms(self) -> dict[str, float]:
        parts: dict[str, float] = {}
        for (_, before), (part, after) in zip(self.marks, self.marks[1:]):
            parts[part] = parts.get(part, 0.0) + (after - before) / 1e6
        return parts

    def total_ms(self) -> float:
        return (self.marks[-1][1] - self.marks[0][1]) / 1e6


def median_seconds(fn: Callable[[], object], repeats: int, device: str | torch.device) -> float:
    """Median seconds of fn(), waiting for queued GPU kernels."""
    synchronize = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@no_grad
def prefill_seconds(source_model, token_ids: list[int], repeats: int) -> float:
    """Median seconds of the source's prefill over `token_ids` (batch 1): every mapper of a fit is timed against it."""
    device = source_model.device
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)[None]  # (1, T)
    return median_seconds(lambda: source_model.model(input_ids=ids, use_cache=True), repeats, device)


@no_grad
def time_against_prefill(mapper: Mapper, content: list, prefill_s: float, repeats: int) -> float:
    """Mapper time over `content` (the source's content-space cache) / `prefill_s`."""
    device = content[0][0].device
    return median_seconds(lambda: mapper.apply(content), repeats, device) / prefill_s
