"""Measured times: a fresh clone of HEAD runs `make repro`, `make test` and `make test-fast`; their wall times
go to timings.md, which the README quotes.

The clone reuses this Python environment (its `.venv` is a link to it, and make is told the install is done),
so the install's time is not part of any figure. Each line of a command's output is timestamped as it streams:
a stage's time is from its "Running stage" line to the next stage line (or the end), so it counts the stage's
process start and DVC's hashing after it; the tests' slowest 15 are pytest's `--durations=15`. Each test command
starts without .pytest_cache, as in a fresh clone (conftest caches a trained model there). Before and after, the
seconds a fresh interpreter takes for a stage's imports say how fast the machine was. Run `make timings`, or:

    python tools/timings.py [--only repro|test|test-fast ...] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("repro", "test", "test-fast")  # the order they run in: repro first, as a user would
STAMP = ".venv/.installed"  # the Makefile's install stamp: `make -o` it and setup does nothing
DURATIONS = 15
QUIET_LOAD = 0.5  # 1-min load average below which the machine counts as quiet at the start
# what every stage process imports before its work: its time, in a fresh interpreter, is the machine's speed as the
# figures felt it (a shared host slows it with no load average to show: 3.5 to 10 s on the same 2-core machine)
FLOOR_IMPORTS = "import torch, transformers.models.qwen3.modeling_qwen3, lm_eval.evaluator"
STAGE_LINE = re.compile(r"^(?:Running stage|Stage) '(?P<name>[^']+)'")
RUNNING_LINE = re.compile(r"^Running stage '(?P<name>[^']+)':")
DURATION_LINE = re.compile(r"^\s*(?P<seconds>\d+\.\d+)s (?P<when>call|setup|teardown)\s+(?P<test>\S+)")
SUMMARY_LINE = re.compile(r"\d+ (?:passed|failed|error)")


def stage_times(lines: list[tuple[float, str]], end: float) -> list[tuple[str, float]]:
    """(stage, seconds) for each stage dvc ran, in order, from (seconds since start, line) of its output.

    A stage runs from its "Running stage 'name':" line to the next line that names a stage ("Running stage"
    or "Stage '...' didn't change, skipping") or to `end`, when the command finished. Skipped stages are not
    listed."""
    marks = [(at, STAGE_LINE.match(line)) for at, line in lines]
    marks = [(at, match) for at, match in marks if match]
    times = []
    for i, (at, match) in enumerate(marks):
        if RUNNING_LINE.match(match.string):
            stop = marks[i + 1][0] if i + 1 < len(marks) else end
            times.append((match["name"], round(stop - at, 1)))
    return times


def slowest_tests(lines: list[str]) -> list[tuple[float, str, str]]:
    """(seconds, phase, test id) of pytest's `--durations` section, slowest first."""
    found = [DURATION_LINE.match(line) for line in lines]
    return [(float(m["seconds"]), m["when"], m["test"]) for m in found if m]


def summary(lines: list[str]) -> str:
    """pytest's closing line ("536 passed, 3 deselected in 721.10s (0:12:01)") without its = rule."""
    found = [line.strip(" =") for line in lines if SUMMARY_LINE.search(line) and " in " in line]
    return found[-1] if found else ""


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:04.1f} s"


def machine() -> dict:
    """What the figures were measured on: cores, the CPU and the load when the run started."""
    model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0]
    return {"cpu": model or platform.processor() or platform.machine(), "cores": os.cpu_count(), "nproc": cores,
            "load_1min": round(load, 2), "quiet": load < QUIET_LOAD, "python": platform.python_version(),
            "system": f"{platform.system()} {platform.release()}"}


def import_floor(repeats: int = 3) -> float:
    """Median seconds a fresh interpreter takes to import what a stage process imports (FLOOR_IMPORTS)."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", FLOOR_IMPORTS], check=True)
        times.append(time.perf_counter() - started)
    return round(sorted(times)[len(times) // 2], 2)


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def uncommitted(out: Path) -> list[str]:
    """Tracked files with changes a clone of HEAD would not have, the output file aside."""
    changed = git("status", "--porcelain", "--untracked-files=no").splitlines()
    paths = [line[3:] for line in changed]
    return [p for p in paths if (ROOT / p).resolve() != out.resolve()]


def clone(commit: str, into: Path) -> Path:
    """A fresh checkout of `commit` from this repository, on this Python environment (linked as `.venv`)."""
    folder = into / "clone"
    subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(ROOT), str(folder)], check=True)
    git("checkout", "--quiet", "--detach", commit, cwd=folder)
    (folder / ".venv").symlink_to(Path(sys.prefix))
    with open(folder / ".git" / "info" / "exclude", "a") as exclude:
        exclude.write(".venv\n")  # .gitignore's `.venv/` names a folder, not a link: git status stays clean
    return folder


def stream(command: list[str], cwd: Path, env: dict, log: Path, echo) -> tuple[int, float, list[tuple[float, str]]]:
    """Run `command`, keeping each output line with its seconds since the start; `echo(at, line)` shows progress.
    Returns the exit code, the wall seconds and the timed lines."""
    lines = []
    start = time.monotonic()
    with open(log, "w", buffering=1) as out:  # line by line: a run stopped midway leaves its log up to there
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, bufsize=1)  # text mode turns tqdm's \r into line ends
        for line in process.stdout:
            at = time.monotonic() - start
            line = line.rstrip("\n")
            out.write(f"[{at:8.1f}] {line}\n")
            lines.append((at, line))
            echo(at, line)
        code = process.wait()
    return code, time.monotonic() - start, lines


def echo_progress(at: float, line: str) -> None:
    """Stage starts, pytest's percentage lines, failures and the closing line: what says how far it got."""
    if RUNNING_LINE.match(line) or line.rstrip().endswith("%]") or SUMMARY_LINE.search(line) or "ERROR" in line:
        print(f"  [{minutes(at)}] {line.strip()[-110:]}", flush=True)


def run_command(name: str, folder: Path, logs: Path) -> dict:
    """`make <name>` in the clone, install skipped; its wall time, per-stage times or pytest's slowest tests."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "VIRTUAL_ENV")}
    # the clone's pipeline, not the one an editable install points at
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    if name != "repro":
        env["PYTEST_ADDOPTS"] = f"{env.get('PYTEST_ADDOPTS', '')} --durations={DURATIONS}".strip()
        # each test command as in a fresh clone: nothing an earlier one cached (conftest's trained periodic model)
        shutil.rmtree(folder / ".pytest_cache", ignore_errors=True)
    print(f"make {name}", flush=True)
    code, wall, lines = stream(["make", "--no-print-directory", "-o", STAMP, name], folder, env,
                               logs / f"{name}.log", echo_progress)
    texts = [line for _, line in lines]
    result = {"name": name, "code": code, "wall": wall, "log": logs / f"{name}.log"}
    if name == "repro":
        result["stages"] = stage_times(lines, wall)
    else:
        result["slowest"] = slowest_tests(texts)[:DURATIONS]
        result["summary"] = summary(texts)
    print(f"make {name}: {minutes(wall)}, exit {code}", flush=True)
    return result


def markdown(commit: str, host: dict, started: str, results: list[dict]) -> str:
    """timings.md: when, what, on what, then each command's wall time and its details."""
    quiet = "a quiet machine" if host["quiet"] else "not a quiet machine: other work may have slowed these figures"
    lines = [
        "# Measured times", "",
        "Written by `make timings` (tools/timings.py): a fresh clone of the commit below ran each command with the "
        "caller's installed environment, so the install is not counted; each test command started without "
        ".pytest_cache.", "",
        f"- date: {started}",
        f"- commit: {commit}",
        f"- machine: {host['cpu']}; {host['cores']} cores, `nproc` {host['nproc']}; {host['system']}, "
        f"Python {host['python']}",
        f"- 1-min load average at start: {host['load_1min']} ({quiet})",
        f"- a stage process's imports (torch, transformers' Qwen3, lm-eval's evaluator; median of 3 fresh "
        f"interpreters): {host['floor_start']} s before the commands, {host['floor_end']} s after", "",
        "| command | wall | exit | result |", "|---|---|---|---|",
    ]
    for r in results:
        note = r.get("summary") or f"{len(r.get('stages', []))} stages run"
        lines.append(f"| `make {r['name']}` | {minutes(r['wall'])} ({r['wall']:.0f} s) | {r['code']} | {note} |")
    for r in results:
        if "stages" in r:
            lines += ["", f"## `make {r['name']}`: seconds per stage", "",
                      "From its \"Running stage\" line to the next stage line: process start and DVC's hashing "
                      "included.", "", "| stage | s |", "|---|---|"]
            lines += [f"| {name} | {seconds:.1f} |" for name, seconds in r["stages"]]
            lines.append(f"| (all stages) | {sum(s for _, s in r['stages']):.1f} |")
        if "slowest" in r:
            lines += ["", f"## `make {r['name']}`: the {DURATIONS} slowest test phases", "",
                      "| s | phase | test |", "|---|---|---|"]
            lines += [f"| {seconds:.1f} | {when} | `{test}` |" for seconds, when, test in r["slowest"]]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=COMMANDS, default=list(COMMANDS),
                        help="the commands to time (in the order repro, test, test-fast); all three by default")
    parser.add_argument("--out", type=Path, default=ROOT / "timings.md", help="the Markdown file (timings.md)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the clone and its logs (kept anyway when a command fails)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    changed = uncommitted(args.out)
    if changed:
        print(f"refused: uncommitted changes to {', '.join(changed)} would not be measured; commit or stash them")
        return 2
    if sys.prefix == sys.base_prefix:
        print("refused: run it with the project's environment (`make timings` or .venv/bin/python), not a system "
              "Python: the clone reuses it")
        return 2
    commit, host = git("rev-parse", "HEAD"), machine()
    host["floor_start"] = import_floor()
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    print(f"commit {commit[:12]}; {host['cpu']}, nproc {host['nproc']}; 1-min load {host['load_1min']}"
          f"{'' if host['quiet'] else ' (not a quiet machine)'}; a stage's imports {host['floor_start']} s; "
          f"environment {sys.prefix} (install time excluded)")
    temp = Path(tempfile.mkdtemp(prefix="kvh-timings-"))
    folder = clone(commit, temp)
    results = [run_command(name, folder, temp) for name in COMMANDS if name in args.only]
    host["floor_end"] = import_floor()
    args.out.write_text(markdown(commit, host, started, results))
    code = max(r["code"] for r in results)
    if args.keep or code:
        print(f"wrote {args.out}; the clone and each command's log are in {temp}")
    else:
        shutil.rmtree(temp)
        print(f"wrote {args.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
