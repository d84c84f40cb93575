"""The command line every stage shares: `--help` that touches nothing, unknown arguments refused, and the
project's refusals printed as one line naming the key, file or model and the fix.

A refusal is an exception of a class derived from `Refusal` (bad params, a corrupted artifact, a model or
dataset that cannot be had, an incompatible pair, a failed control) or a missing file. It is printed as
`error: <sentence>` on stderr with exit status 2; set KVH_TRACEBACK=1 to get the traceback instead. Any
other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Callable

TRACEBACK_ENV = "KVH_TRACEBACK"


class Refusal(Exception):
    """Base of the errors that are the user's to fix (their message says how), not the code's."""


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    """An argument parser for `python -m <module>` whose help is the module's docstring."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def no_arguments(module: str, doc: str, argv: list[str] | None) -> None:
    """For a stage that takes no arguments: `--help` prints its docstring, anything else is refused."""
    parser(module, doc + "\nThis stage takes no arguments: it reads params.yaml.").parse_args(argv)


def entry(main: Callable[[list[str]], object]) -> None:
    """Run a stage's main(argv) with the command line's arguments; a refusal exits 2 with one line."""
    try:
        main(sys.argv[1:])
    except (Refusal, FileNotFoundError) as err:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def run_stage(module: str, *args: str) -> None:
    """Another stage's own command, `python -m <module> args...`, in a fresh process with its output silenced: a
    stage's narrow refit or scratch extraction runs exactly the code the pipeline runs. A failure stops the
    caller. Name the module as a literal (`run_stage("pipeline.fit", ...)`): tests/importgraph.py reads it from
    the call, so the caller's dvc.yaml deps list that stage's modules."""
    subprocess.run([sys.executable, "-m", module, *args], check=True, stdout=subprocess.DEVNULL)
