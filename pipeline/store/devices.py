"""Torch dtypes and devices by name, as params.yaml spells them, what a stage used of its device, and
torch's no_grad as a decorator that imports torch at the first call (`store.lazy`), not with the module."""
from __future__ import annotations

import functools
import os
import resource
import time
from pathlib import Path
from typing import Annotated, Callable, get_args

from pydantic import BeforeValidator

from pipeline.store.lazy import lazy
from pipeline.store.params import Dtype

torch = lazy("torch")

DTYPES = get_args(Dtype)  # torch's names of the dtypes params.yaml can name: float32, bfloat16, float16


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, name)


@functools.cache
def cpu_matmul_ms() -> tuple[float, float]:
    """(float32 ms, bfloat16 ms) of one matmul on this CPU at torch's threads, timed once a process."""
    return tuple(matmul_ms(("float32", "bfloat16"), torch.get_num_threads()))


@functools.cache
def machine_dtype() -> tuple[str, dict]:
    """What `dtype: auto` runs the models in here, and why: bfloat16 on a GPU; on a CPU, the faster at a matmul (the
    two differ by 3x or more on every CPU measured, so every stage of a run makes one choice)."""
    if torch.cuda.is_available():
        return "bfloat16", {"device": "cuda"}
    float32_ms, bfloat16_ms = cpu_matmul_ms()
    figures = {"device": "cpu", "threads": torch.get_num_threads(), "float32_ms": round(float32_ms, 2),
               "bfloat16_ms": round(bfloat16_ms, 2)}
    return ("bfloat16" if bfloat16_ms < float32_ms else "float32"), figures


def resolved(dtype: str) -> str:
    return machine_dtype()[0] if dtype == "auto" else dtype


FACE_DTYPES = (*DTYPES, "auto")  # what a face (the API, kv-transfer, generate) accepts for the models' dtype
ModelDtype = Annotated[Dtype, BeforeValidator(resolved)]  # a section's: `auto` resolved where it is parsed


def no_grad(function: Callable) -> Callable:
    """`@torch.no_grad()` for a module that must not import torch on import."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        with torch.no_grad():
            return function(*args, **kwargs)
    return call


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class StageUsage:
    """A stage's wall time and peak memory since construction, for its metrics JSON: the CUDA allocator's peak on a
    GPU (reset at the start), the process's peak resident set on the CPU (ru_maxrss, since the process started)."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self.started = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def figures(self) -> dict:
        if self.device.type == "cuda":
            peak, kind = torch.cuda.max_memory_allocated(self.device) / 2**20, "cuda allocator"
        else:
            peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "process rss"
        figures = {"wall_s": round(time.perf_counter() - self.started, 2), "peak_memory_mib": round(peak, 1),
                   "peak_memory_of": kind, "device": str(self.device)}
        # in a copy DVC made for an experiment (`dvc queue start -j N` runs several at once), DVC_ROOT is the repository
        root = os.environ.get("DVC_ROOT")
        if root and Path(root).resolve() != Path.cwd().resolve():
            figures["timing_note"] = SHARED_NOTE
        return figures


SHARED_NOTE = ("run in a DVC experiment's own copy (dvc exp run --queue or --temp): other experiments may have "
               "shared the machine, so wall times and peaks are not comparable across runs")


def usage_of_ranks(figures: list[dict]) -> dict:
    """One stage's figures from its processes' (rank order): the slowest wall time, the largest peak and each's."""
    if len(figures) == 1:
        return figures[0]
    return {**figures[0], "wall_s": max(f["wall_s"] for f in figures),
            "peak_memory_mib": max(f["peak_memory_mib"] for f in figures),
            "peak_memory_mib_per_rank": [f["peak_memory_mib"] for f in figures], "processes": len(figures)}


def matmul_ms(dtypes: tuple[str, ...], threads: int, size: int = 512, repeats: int = 3) -> list[float]:
    """The median ms of one (size x size) @ (size x size) CPU matmul in each of `dtypes` at `threads` threads."""
    torch.set_num_threads(threads)
    times = []
    for name in dtypes:
        a, b = (torch.randn(size, size, generator=torch.Generator().manual_seed(seed)).to(parse_dtype(name))
                for seed in (0, 1))
        a @ b  # the first call pays for the kernel's setup
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            runs.append((time.perf_counter() - start) * 1000)
        times.append(sorted(runs)[len(runs) // 2])
    return times
