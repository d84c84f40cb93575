"""Time to first token (TTFT) of the handoff against ordinary target prefill, and the mapper's cost.

For a prompt c[0..n-1] (PROTOCOL.md, "Latency study"):

    (a) target:   target(c[0..n-1]), last position's logits only                    -> first token
    (b) handoff:  source body(c[0..n-2]) | strip, map, apply RoPE, cast | target(c[n-1]) -> first token
                  "source"                 "map" (and the handoff's repair)  "step"

Both paths run in one process on the same inputs, alternating repeat by repeat, so drift and other
processes' load fall on both alike; each length gets warm-up runs first. Clocks are read after a CUDA
synchronize on a GPU. Reported per length: median and interquartile range of each path, the medians of
(b)'s parts, speedup (a)/(b) beside the FLOP-model bound (`kv.flops`) and the achieved fraction of it.

Memory: the peak of torch-allocated bytes during one untimed run of each path, above what was allocated
before it (the weights): `torch.cuda.max_memory_allocated` on a GPU; on a CPU the running sum of the CPU
allocator's allocation and free events recorded by `torch.profiler`. Memory allocated outside torch's
allocator (Python objects, BLAS scratch) is not counted.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from tqdm.auto import tqdm

from pipeline.kv.flops import source_scores_macs, speedup_bound
from pipeline.kv.geometry import kv_geometry
from pipeline.kv.handoff import FirstStep, Handoff
from pipeline.kv.kvcache import Prefixes
from pipeline.kv.mapper import random_mapper
from pipeline.kv.pair import Pair
from pipeline.measure.timing import Stopwatch, read_clock
from pipeline.store.artifacts import atomic_path, write_bytes_atomic
from pipeline.store.devices import no_grad
from pipeline.store.lazy import lazy
from pipeline.store.params import ParamError
from pipeline.store.shapes import pair_configs, random_model

torch = lazy("torch")
torch_profiler = lazy("torch.profiler")
matplotlib = lazy("matplotlib")
ticker = lazy("matplotlib.ticker")
plt = lazy("matplotlib.pyplot")

MIB = 2**20


def check_lengths(lengths: list[int], where: str) -> None:
    if not lengths:
        raise ParamError(f"{where}: expected at least one prompt length")
    for index, length in enumerate(lengths):
        if isinstance(length, bool) or not isinstance(length, int) or length < 2:
            raise ParamError(
                f"{where}[{index}]: expected an integer >= 2 (a prefix for the source and a last token for the "
                f"target), got {length!r}"
            )
    if len(set(lengths)) != len(lengths):
        raise ParamError(f"{where}: repeated prompt length in {lengths}; list each length once")


@no_grad
def target_first_token(target, ids: torch.Tensor):
    """Path (a): the target prefills ids (1, n); returns its output (cache and last logits)."""
    output = target(input_ids=ids, use_cache=True, logits_to_keep=1)
    output.logits[0, -1].argmax().item()  # the first token, on the host as a server would need it
    return output


@no_grad
def handoff_first_token(handoff: Handoff, ids: torch.Tensor) -> tuple[FirstStep, Stopwatch]:
    """Path (b) for ids (1, n): the handoff's first step (`Handoff.first_step`) and the clock that timed its parts
    (`prefill`, the source's; `map`, with the repair; `step`)."""
    clock = Stopwatch(handoff.device)
    return handoff.first_step(Prefixes.of(ids), clock), clock


def time_target(target, ids: torch.Tensor) -> float:
    start = read_clock(target.device)
    target_first_token(target, ids)
    return (read_clock(target.device) - start) / 1e6


def time_handoff(handoff: Handoff, ids: torch.Tensor) -> dict[str, float]:
    """Milliseconds of path (b) and of each of its parts, from one run."""
    _, clock = handoff_first_token(handoff, ids)
    parts = clock.parts_ms()
    return {"handoff": clock.total_ms(), "source": parts["prefill"], "map": parts["map"], "step": parts["step"]}


def peak_bytes(run: Callable[[], object], device: torch.device) -> int:
    """Peak torch-allocated bytes above the level before `run`, while it runs and while its result lives."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        result = run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del result
        return peak
    with torch_profiler.profile(activities=[torch_profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        result = run()
    del result
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in profiler.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    )
    if not events:
        raise RuntimeError(
            "torch.profiler recorded no CPU memory events; this torch version does not expose them as expected, "
            "so CPU peak memory cannot be measured (use a GPU, or update peak_bytes for this torch)"
        )
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


def _quantile(samples: list[float], q: float) -> float:
    return float(torch.tensor(samples, dtype=torch.float64).quantile(q))


def _iqr(samples: list[float]) -> float:
    return _quantile(samples, 0.75) - _quantile(samples, 0.25)


def measure(handoff: Handoff, lengths: list[int], warmup: int, repeats: int, memory: bool = True,
            progress: bool = True) -> list[dict]:
    """One row per length: timings (ms), the FLOP bound and, with `memory`, peak memory (MiB) of both paths.

    Memory takes one more (untimed, profiled on a CPU) run of each path per length."""
    target, source, mapper = handoff.decoder, handoff.source, handoff.mapper
    mapper_macs = mapper.macs_per_token()
    geometry = kv_geometry(target.config)
    cache_bytes_per_token = 2 * geometry["layers"] * geometry["kv_heads"] * geometry["head_dim"] * target.dtype.itemsize
    generator = torch.Generator().manual_seed(0)
    rows = []
    bar = tqdm(total=len(lengths) * (warmup + repeats), desc="latency", disable=not progress)
    for length in lengths:
        if length > target.config.max_position_embeddings:
            print(
                f"note: length {length} exceeds the target's max_position_embeddings "
                f"({target.config.max_position_embeddings}); timed anyway, as time does not depend on the values",
                file=sys.stderr,
            )
        ids = torch.randint(0, target.config.vocab_size, (1, length), generator=generator).to(handoff.device)
        samples: dict[str, list[float]] = {"target": [], "handoff": [], "source": [], "map": [], "step": []}
        bar.set_description(f"latency n={length}")
        for repeat in range(warmup + repeats):
            target_ms, handoff_ms = time_target(target, ids), time_handoff(handoff, ids)
            if repeat >= warmup:
                samples["target"].append(target_ms)
                for name, value in handoff_ms.items():
                    samples[name].append(value)
            bar.update()
        median = {name: _quantile(values, 0.5) for name, values in samples.items()}
        bound = speedup_bound(source.config, target.config, mapper_macs, length, handoff.repair,
                              source_scores_macs(source.config, handoff.repair, handoff.speculative, length))
        speedup = median["target"] / median["handoff"]
        rows.append({
            "length": length,
            "target_ms": median["target"],
            "target_iqr_ms": _iqr(samples["target"]),
            "handoff_ms": median["handoff"],
            "handoff_iqr_ms": _iqr(samples["handoff"]),
            "source_ms": median["source"],
            "map_ms": median["map"],
            "step_ms": median["step"],
            "map_share": median["map"] / median["handoff"],
            "speedup": speedup,
            "bound": bound,
            "fraction_of_bound": speedup / bound,
            "cache_mib": length * cache_bytes_per_token / MIB,
        })
        if memory:
            rows[-1]["target_peak_mib"] = peak_bytes(lambda: target_first_token(target, ids), handoff.device) / MIB
            rows[-1]["handoff_peak_mib"] = peak_bytes(lambda: handoff_first_token(handoff, ids), handoff.device) / MIB
    bar.close()
    return rows


def environment(handoff: Handoff, repeats: int, warmup: int) -> dict:
    device = handoff.device
    mapper = handoff.mapper
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(handoff.decoder.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "repeats": repeats,
        "warmup": warmup,
        "mapper_family": mapper.family,
        "mapper_k": mapper.k,
        "memory_method": (
            "torch.cuda.max_memory_allocated" if device.type == "cuda" else "torch.profiler CPU allocator events"
        ),
    }


def length_metrics(rows: list[dict], env: dict) -> dict:
    """The environment's figures, then each prompt length's row under `by_length/<tokens>/`."""
    return {**env, "by_length": {str(row["length"]): {key: value for key, value in row.items() if key != "length"}
                                 for row in rows}}


def format_table(rows: list[dict], env: dict) -> str:
    columns = ("length", "target_ms", "handoff_ms", "source_ms", "map_ms", "step_ms", "speedup", "bound",
               "fraction_of_bound", "map_share", "target_peak_mib", "handoff_peak_mib")
    columns = [name for name in columns if name in rows[0]]
    lines = [
        f"device {env['device']}, dtype {env['dtype']}, {env['threads']} threads, torch {env['torch_version']}, "
        f"median of {env['repeats']} after {env['warmup']} warm-up, mapper {env['mapper_family']} k={env['mapper_k']}",
        " ".join(f"{name:>17}" for name in columns),
    ]
    for row in rows:
        lines.append(" ".join(f"{row[name]:>17}" if name == "length" else f"{row[name]:>17.3f}" for name in columns))
    return "\n".join(lines)


def write_table(rows: list[dict], path: Path) -> None:
    columns = list(rows[0])
    text = ",".join(columns) + "\n" + "".join(",".join(f"{row[c]:.6g}" for c in columns) + "\n" for row in rows)
    write_bytes_atomic(path, text.encode())


def write_plot(rows: list[dict], env: dict, path: Path) -> None:
    lengths = [row["length"] for row in rows]
    matplotlib.use("Agg")  # figures go to files only; chosen before pyplot draws, not when this module is imported
    figure, axes = plt.subplots(figsize=(6, 4))
    for name, label in (("target", "(a) target prefill"), ("handoff", "(b) handoff")):
        axes.errorbar(lengths, [row[f"{name}_ms"] for row in rows], yerr=[row[f"{name}_iqr_ms"] / 2 for row in rows],
                      marker="o", capsize=3, label=label)
    axes.plot(lengths, [row["target_ms"] / row["bound"] for row in rows], "k--", linewidth=1,
              label="(b) at the FLOP bound")
    axes.set(xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="time to first token (ms)",
             title=f"TTFT (median, bars: IQR), {env['device']} {env['dtype']}, threads={env['threads']}")
    axes.xaxis.set_minor_locator(ticker.NullLocator())
    axes.set_xticks(lengths, [str(n) for n in lengths])
    axes.legend()
    figure.tight_layout()
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=120)
    plt.close(figure)


def run(handoff: Handoff, lengths: list[int], warmup: int, repeats: int,
        memory: bool = True) -> tuple[list[dict], dict]:
    """Rows of `measure` and the environment they were measured in."""
    return measure(handoff, lengths, warmup, repeats, memory), environment(handoff, repeats, warmup)


def random_pair_handoff(pair: str, dtype: str, device: str, k: int, family: str, width: int | None = None) -> Handoff:
    """The handoff between random models of a named pair's real shapes, through a random mapper of `family`, k
    and `width` (the family's inner size, where it has one)."""
    source_config, target_config = pair_configs(pair)
    target = random_model(target_config, dtype, device, seed=1)
    source = random_model(source_config, dtype, device, seed=2)
    mapper = random_mapper(source_config, target_config, k, family, width=width).to(device)
    return Pair.of(target, source).handoff("mapped", mapper)
