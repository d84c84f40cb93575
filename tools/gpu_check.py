"""`make gpu-check`: the V0 code path at real shapes on one GPU, end to end, with one table printed.

1. The `qwen3-shapes` profile (random weights of Qwen3-0.6B/1.7B's exact configs, the tiny world's data, no
   hub) through `report`, in bfloat16 on the GPU, in a scratch copy of this checkout (the workspace and its
   DVC cache are untouched);
2. the latency study at real shapes: `python -m pipeline.latency --config-shapes qwen3-v0` at 512, 2048 and
   8192 tokens, 10 repeats.

Then it prints, from each stage's metrics JSON, the wall time, peak memory and device per stage, and the TTFT
of the handoff against target prefill with the FLOP bound. `--profile tiny --device cpu` runs the same
mechanics on a machine without a GPU (with `--set` overrides that shrink it, a few minutes).

    python tools/gpu_check.py [--profile qwen3-shapes] [--device cuda] [--lengths 512,2048,8192] [--repeats 10]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("pipeline", "conf", "dvc.yaml", "pyproject.toml", ".dvcignore")
STAGE_METRICS = {  # stage -> its metrics file, relative to the run's folder
    "score_models": "metrics/models.json", "extract@source": "metrics/extract_source.json",
    "extract@target": "metrics/extract_target.json", "fit": "metrics/fit.json", "distill": "metrics/distill.json",
    "select": "metrics/select.json",
    "controls": "metrics/controls_usage.json",
}


def scratch_copy(folder: Path) -> None:
    """The pipeline's sources in `folder`, as a fresh DVC project without git (nothing of the workspace's state)."""
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.exists():
            shutil.copy2(source, folder / name)
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=folder, check=True)


def compose(folder: Path, overrides: list[str]) -> None:
    from dvc.utils.hydra import compose_and_dump

    compose_and_dump(str(folder / "params.yaml"), str(folder / "conf"), None, "config", str(folder), overrides)


def run(command: list[str], folder: Path) -> float:
    started = time.perf_counter()
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(command, cwd=folder, check=True, env=env)
    return time.perf_counter() - started


def stage_rows(folder: Path) -> list[list[str]]:
    rows = []
    files = {**STAGE_METRICS, **{f"evaluate {path.stem}": f"metrics/eval/{path.name}"
                                 for path in sorted((folder / "metrics/eval").glob("*.json"))}}
    for stage, relative in files.items():
        path = folder / relative
        figures = json.loads(path.read_text()) if path.is_file() else {}
        if "wall_s" in figures:
            rows.append([stage, f"{figures['wall_s']:.1f}", f"{figures['peak_memory_mib']:.0f}",
                         figures["peak_memory_of"], figures["device"]])
        else:
            rows.append([stage, "—", "—", "—", "skipped" if "skipped" in figures else "no figures"])
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
                      *("| " + " | ".join(row) + " |" for row in rows)])


def main(argv: list[str] | None = None) -> None:
    cli = argparse.ArgumentParser(prog="python tools/gpu_check.py", description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--profile", default="qwen3-shapes")
    cli.add_argument("--device", default="cuda")
    cli.add_argument("--lengths", default="512,2048,8192")
    cli.add_argument("--repeats", type=int, default=10)
    cli.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                     help="more Hydra overrides of the profile (e.g. smaller counts for a CPU dry run)")
    cli.add_argument("--keep", type=Path, help="run in this folder and keep it (default: a temporary one)")
    args = cli.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            cli.error("no CUDA device here: run it on a GPU machine, or pass --profile tiny --device cpu")
    folder = args.keep or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    folder.mkdir(parents=True, exist_ok=True)
    scratch_copy(folder)
    compose(folder, [f"profile={args.profile}", f"machine.device={args.device}",
                     *args.set])
    pipeline_s = run([sys.executable, "-m", "dvc", "repro", "-q"], folder)
    latency_json = folder / "latency-real-shapes.json"
    latency_s = run([sys.executable, "-m", "pipeline.latency", "--config-shapes", "qwen3-v0", "--device", args.device,
                     "--dtype", "bfloat16", "--lengths", args.lengths, "--repeats", str(args.repeats), "--out",
                     str(latency_json)], folder)
    print(f"\n## gpu-check: profile {args.profile} on {args.device}, pipeline {pipeline_s:.0f} s, "
          f"latency study {latency_s:.0f} s\n")
    print(table(["stage", "wall s", "peak MiB", "peak of", "device"], stage_rows(folder)))
    latency = json.loads(latency_json.read_text())
    lengths = sorted(map(int, latency["by_length"]))
    print(f"\nTTFT, Qwen3-0.6B -> 1.7B shapes, bfloat16, median of {args.repeats} (handoff: source prefill, map "
          f"k=1 linear, target step):\n")

    def row(n: int, key: str, fmt: str) -> str:
        return format(latency["by_length"][str(n)][key], fmt)

    print(table(["prompt tokens", "target prefill ms", "handoff ms", "speedup", "FLOP bound", "fraction of bound",
                 "target peak MiB", "handoff peak MiB"],
                [[str(n), row(n, "target_ms", ".2f"), row(n, "handoff_ms", ".2f"), row(n, "speedup", ".2f") + "x",
                  row(n, "bound", ".2f") + "x", row(n, "fraction_of_bound", ".1%"),
                  row(n, "target_peak_mib", ".0f"), row(n, "handoff_peak_mib", ".0f")] for n in lengths]))
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
