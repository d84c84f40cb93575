"""Time to first token (TTFT) of the handoff against ordinary target prefill, and the mapper's cost.

For a prompt c[0..n-1] (PROTOCOL.md, "Latency study"), with (b)'s parts named as in the rows (`source_ms`, ...):

    (a) target:   target(c[0..n-1]), last position's logits only                    -> first token
    (b) handoff:  source body(c[0..n-2]) | strip, map, apply RoPE, cast | target(c[n-1]) -> first token
                  "source"                 "map" (a repair: its own part)    "step"

Both paths run in one process on the same inputs, alternating repeat by repeat, so drift and other processes' load
fall on both alike; speedup (a)/(b) is reported beside the FLOP-model bound (`kv.flops`)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from tqdm.auto import tqdm

from pipeline.kv.flops import first_step_macs, source_scores_macs, speedup_bound, target_prefill_macs
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
    """Path (a) for ids (1, n)."""
    output = target(input_ids=ids, use_cache=True, logits_to_keep=1)
    output.logits[0, -1].argmax().item()  # the first token, on the host as a server would need it
    return output


@no_grad
def handoff_first_token(handoff: Handoff, ids: torch.Tensor) -> tuple[FirstStep, Stopwatch]:
    """Path (b) for ids (1, n), and the clock that timed its parts."""
    clock = Stopwatch(handoff.device)
    return handoff.first_step(Prefixes.of(ids), clock), clock


def time_handoff(handoff: Handoff, ids: torch.Tensor) -> dict[str, float]:
    """Milliseconds of path (b), `handoff`, and of each part, from one run."""
    _, clock = handoff_first_token(handoff, ids)
    return {"handoff": clock.total_ms(), **clock.parts_ms()}


def part_macs(handoff: Handoff, length: int) -> dict[str, int]:
    mapper = 0 if handoff.mapper is None else handoff.mapper.macs_per_token()
    return first_step_macs(handoff.source.config, handoff.decoder.config, length, mapper, handoff.repair,
                           handoff.speculative, handoff.share)


def decomposition(samples: list[dict[str, float]], target_ms: float, macs: dict[str, int], target_macs: int) -> dict:
    """Median time, speedup and FLOP bound, and per part its median ms, its shares of the target prefill's time and
    multiply-adds, and their ratio (1: the part runs at its multiply-adds' cost; above: slower)."""
    handoff_ms = _quantile([sample["handoff"] for sample in samples], 0.5)
    parts = {}
    for part, part_count in macs.items():
        ms = _quantile([sample.get(part, 0.0) for sample in samples], 0.5)
        time_share, macs_share = ms / target_ms, part_count / target_macs
        parts[part] = {"ms": ms, "time_share": time_share, "macs_share": macs_share,
                       "ratio": time_share / macs_share if macs_share > 0 else None}
    bound = target_macs / sum(macs.values())
    return {"handoff_ms": handoff_ms, "speedup": target_ms / handoff_ms, "bound": bound,
            "fraction_of_bound": target_ms / handoff_ms / bound, "parts": parts}


def peak_bytes(run: Callable[[], object], device: torch.device) -> int:
    """Peak torch-allocated bytes above the level before `run` while it and its result live: on a CPU the running sum
    of the allocator's events `torch.profiler` records. Memory outside torch's allocator is not counted."""
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


def alternated(target, handoffs: dict[str, Handoff], ids: torch.Tensor, warmup: int, repeats: int, bar
               ) -> tuple[list[float], dict[str, list[dict[str, float]]]]:
    """The target prefill's ms and each handoff's parts per timed repeat (paths in turn within a repeat)."""
    timed: dict[str, list[dict[str, float]]] = {name: [] for name in handoffs}
    targets: list[float] = []
    for repeat in range(warmup + repeats):
        start = read_clock(target.device)
        target_first_token(target, ids)
        target_ms = (read_clock(target.device) - start) / 1e6
        runs = {name: time_handoff(each, ids) for name, each in handoffs.items()}
        if repeat >= warmup:
            targets.append(target_ms)
            for name, parts in runs.items():
                timed[name].append(parts)
        bar.update()
    return targets, timed


def measure(handoff: Handoff, lengths: list[int], warmup: int, repeats: int, memory: bool = True,
            progress: bool = True, rivals: dict[str, Handoff] | None = None) -> list[dict]:
    """One row per length: timings (ms), the FLOP bound, with `memory` peak MiB of both paths (one more untimed run
    each), and under `parts` the decomposition of `handoff` (as `mapped`) and `rivals`, timed in the same repeats."""
    target, source, mapper = handoff.decoder, handoff.source, handoff.mapper
    handoffs = {"mapped": handoff, **(rivals or {})}
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
        target_macs = target_prefill_macs(target.config, length)
        bar.set_description(f"latency n={length}")
        targets, timed = alternated(target, handoffs, ids, warmup, repeats, bar)
        median = {"target": _quantile(targets, 0.5)} | {
            name: _quantile([run.get(part, 0.0) for run in timed["mapped"]], 0.5)
            for name, part in (("handoff", "handoff"), ("source", "prefill"), ("map", "map"), ("step", "step"))}
        bound = speedup_bound(source.config, target.config, mapper_macs, length, handoff.repair,
                              source_scores_macs(source.config, handoff.repair, handoff.speculative, length))
        speedup = median["target"] / median["handoff"]
        rows.append({
            "length": length,
            "target_ms": median["target"],
            "target_iqr_ms": _iqr(targets),
            "handoff_ms": median["handoff"],
            "handoff_iqr_ms": _iqr([run["handoff"] for run in timed["mapped"]]),
            "source_ms": median["source"],
            "map_ms": median["map"],
            "step_ms": median["step"],
            "map_share": median["map"] / median["handoff"],
            "speedup": speedup,
            "bound": bound,
            "fraction_of_bound": speedup / bound,
            "cache_mib": length * cache_bytes_per_token / MIB,
            "parts": {name: decomposition(timed[name], median["target"], part_macs(each, length), target_macs)
                      for name, each in handoffs.items()},
        })
        if memory:
            rows[-1]["target_peak_mib"] = peak_bytes(lambda: target_first_token(target, ids), handoff.device) / MIB
            rows[-1]["handoff_peak_mib"] = peak_bytes(lambda: handoff_first_token(handoff, ids), handoff.device) / MIB
    bar.close()
    return rows


def length_metrics(rows: list[dict], env: dict) -> dict:
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
    # each handoff's parts at each length: ms, share of the target prefill's time and of its multiply-adds, ratio
    lines += ["", f"{'length':>7} {'handoff':>36} {'part':>8} {'ms':>10} {'time share':>11} {'MAC share':>10} "
                  f"{'ratio':>7}"]
    for row in rows:
        for name, each in row["parts"].items():
            for part, figures in each["parts"].items():
                ratio = "-" if figures["ratio"] is None else f"{figures['ratio']:.2f}"
                lines.append(f"{row['length']:>7} {name:>36} {part:>8} {figures['ms']:>10.2f} "
                             f"{figures['time_share']:>11.2%} {figures['macs_share']:>10.2%} {ratio:>7}")
    return "\n".join(lines)


def write_table(rows: list[dict], path: Path) -> None:
    columns = [name for name, value in rows[0].items() if not isinstance(value, dict)]  # the parts: in the metrics
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


def run(handoff: Handoff, lengths: list[int], warmup: int, repeats: int, memory: bool = True,
        rivals: dict[str, Handoff] | None = None) -> tuple[list[dict], dict]:
    device, mapper = handoff.device, handoff.mapper
    return measure(handoff, lengths, warmup, repeats, memory, rivals=rivals), {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(handoff.decoder.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "repeats": repeats,
        "warmup": warmup,
        "mapper_family": mapper.family,
        "mapper_k": mapper.k,
        "memory_method": ("torch.cuda.max_memory_allocated" if device.type == "cuda"
                          else "torch.profiler CPU allocator events"),
    }


def random_pair_handoff(pair: str, dtype: str, device: str, k: int, family: str, width: int | None = None) -> Handoff:
    """The handoff between random models of a named pair's shapes through a random mapper."""
    source_config, target_config = pair_configs(pair)
    target = random_model(target_config, dtype, device, seed=1)
    source = random_model(source_config, dtype, device, seed=2)
    mapper = random_mapper(source_config, target_config, k, family, width=width).to(device)
    return Pair.of(target, source).handoff("mapped", mapper)
