"""Stage `latency`: time to first token of the handoff against ordinary target prefill (`measure.latency`).

    python -m pipeline.latency
        the DVC stage: params.yaml `latency`, the prepared pair (models/) and the mapper `latency.mapper`;
        writes metrics/latency.json, plots/latency.csv and plots/latency.png
    python -m pipeline.latency --config-shapes qwen3-v0 [--device cpu] [--dtype bfloat16] [--lengths 512,2048]
        the same measurement on random models of a pair's real shapes with a random mapper; prints the
        table (and writes --out), touches no stage output
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.kv.families import CLOSED_FORM
from pipeline.kv.pair import Pair
from pipeline.kv.speculative import chosen_lookahead
from pipeline.measure.latency import (
    check_lengths,
    format_table,
    length_metrics,
    random_pair_handoff,
    run,
    write_plot,
    write_table,
)
from pipeline.schema.latency import LatencyParams
from pipeline.store import inputs, paths
from pipeline.store.artifacts import write_json_atomic
from pipeline.store.cli import entry, parser
from pipeline.store.devices import DTYPES, default_device
from pipeline.store.lazy import lazy
from pipeline.store.machine import MachineParams
from pipeline.store.params import ParamError, load_section
from pipeline.store.ranks import stage_ranks
from pipeline.store.shapes import PAIRS

torch = lazy("torch")


def stage(params: LatencyParams, machine: MachineParams) -> dict:
    device = machine.torch_device
    with stage_ranks(device, threads=machine.threads) as timed:
        pair = Pair(str(paths.model("target")), str(paths.model("source")), params.dtype, device)
        router = pair.router(mode="mapped", mapper=params.mapper)
        rows, env = run(router.handoff, params.lengths, params.warmup, params.repeats, rivals=rivals(pair, params))
        write_table(rows, paths.LATENCY_TABLE)
        write_plot(rows, env, paths.LATENCY_PLOT)
        print(format_table(rows, env))
        return timed.write_metrics(paths.LATENCY, length_metrics(rows, env))


def rivals(pair: Pair, params: LatencyParams) -> dict:
    """The handoffs timed beside the map: the map with each repair, speculative prefill at each share (under the
    look-ahead settings select chose wherever a handoff reads them)."""
    lookahead = chosen_lookahead(paths.LOOKAHEAD)
    out = {}
    for setting in params.settings():
        reads = lookahead if setting.reads_source else None
        out[f"mapped+{setting}"] = pair.router(mode="mapped", mapper=params.mapper, repair=setting,
                                               speculative=reads).handoff
    for share in params.speculative:
        out[f"speculative:{share:g}"] = pair.router(mode="speculative", share=share, speculative=lookahead).handoff
    return out


def shapes_benchmark(args: argparse.Namespace) -> dict:
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    handoff = random_pair_handoff(args.config_shapes, args.dtype, args.device, args.k, args.family, args.width)
    rows, env = run(handoff, args.lengths, args.warmup, args.repeats, memory=not args.no_memory)
    metrics = {**length_metrics(rows, env), "pair": args.config_shapes}
    print(format_table(rows, env))
    if args.out:
        write_json_atomic(args.out, metrics)
    return metrics


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths {text!r}: expected integers separated by commas, e.g. 512,2048")
    try:
        check_lengths(lengths, "--lengths")
    except ParamError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return lengths


def parse_args(argv: list[str]) -> argparse.Namespace:
    cli = parser("pipeline.latency", __doc__)
    bench = cli.add_argument_group("real-shape benchmark (only with --config-shapes)")
    bench.add_argument("--config-shapes", choices=sorted(PAIRS), help="model pair whose shapes to build")
    bench.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda where there is one)")
    bench.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    bench.add_argument("--lengths", type=_lengths, default=[512, 2048, 8192], help="comma-separated prompt lengths")
    bench.add_argument("--warmup", type=int, default=1)
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 keeps torch's default")
    bench.add_argument("--k", type=int, default=1, help="source layers per target layer in the random mapper")
    bench.add_argument("--family", choices=CLOSED_FORM, default="linear",
                       help="the random map's family (one with an inner size takes --width)")
    bench.add_argument("--width", type=int, help="the family's inner size (the low_rank family's rank)")
    bench.add_argument("--no-memory", action="store_true",
                       help="skip the peak-memory runs (one more run of each path per length)")
    bench.add_argument("--out", type=Path, help="also write the flat metrics to this JSON file")
    args = cli.parse_args(argv)
    # here, not as the default: --help should not import torch; a device this machine lacks, or meta, is one line
    args.device = inputs.device(args.device, "--device") if args.device else default_device()
    if args.config_shapes is None and argv:
        cli.error("benchmark options need --config-shapes; the stage takes no arguments (it reads params.yaml)")
    if args.repeats < 1 or args.warmup < 0 or args.threads < 0:
        cli.error("--repeats must be >= 1, --warmup and --threads >= 0")
    inputs.out_file(args.out, "--out")  # now, not after the benchmark
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.config_shapes is None:
        stage(load_section(LatencyParams, "latency"), load_section(MachineParams, "machine"))
    else:
        shapes_benchmark(args)


if __name__ == "__main__":
    entry(main)
