"""The command line every stage shares: `--help` that touches nothing, unknown arguments refused, and the
project's refusals printed as one line naming the key, file or model and the fix.

A refusal is an exception of a class derived from `Refusal` (bad params, a corrupted artifact, a model or
dataset that cannot be had, an incompatible pair, a failed control) or a missing file. It is printed as
`error: <sentence>` on stderr with exit status 2; set KVH_TRACEBACK=1 to get the traceback instead. Any
other exception is a bug and keeps its traceback.

A stage run as a command (`python -m pipeline.<stage>`) that succeeds ends without the interpreter's teardown:
its outputs are written and renamed by then, and destroying the hundreds of thousands of objects torch,
transformers and lm-eval leave behind costs about a second per process (25 stage processes in a tiny run).
Every exit handler registered while the stage ran (torch's, multiprocessing's, lm-eval's) still runs first.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import io
import logging
import os
import subprocess
import sys
from typing import Callable

from pipeline.store.lazy import lazy

torch = lazy("torch")

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
    """Run a stage's main(argv) with the command line's arguments; a refusal exits 2 with one line. A main run as
    the command itself (defined in `__main__`) that returns ends the process without the interpreter's teardown
    (the module's docstring); called from another module (a test), entry only returns."""
    as_command = main.__module__ == "__main__"
    if as_command:
        atexit.register(_end_without_teardown)  # runs after the exit handlers registered while main runs
    try:
        main(sys.argv[1:])
    except (Refusal, FileNotFoundError) as err:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if as_command:
        _SUCCEEDED.append(True)


_SUCCEEDED: list[bool] = []  # a command's main returned: its exit may skip the teardown


def _end_without_teardown() -> None:
    """The last exit handler of a command whose main returned: flush what is buffered and end the process with
    status 0, skipping the destruction of every module's objects. After a failure it returns: the interpreter
    ends as usual, with the failure's status."""
    if not _SUCCEEDED:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_stage(module: str, *args: str, fresh_process: bool = False) -> None:
    """Another stage's own command, as `python -m <module> args...` runs it, with its output silenced: a stage's
    narrow refit or scratch extraction runs exactly the code the pipeline runs. A failure stops the caller.

    In this process by default: the interpreter, torch and lm-eval are loaded already, so the call costs its work
    only (a fresh process costs seconds of start-up each: four per calibration point). The caller's torch thread
    count and random state are kept (every stage seeds its own generators, so its outputs are those of a fresh
    process). `fresh_process=True` starts a new interpreter instead, for a check that needs another process (the
    determinism control). Name the module as a literal (`run_stage("pipeline.fit", ...)`): tests/importgraph.py
    reads it from the call, so the caller's dvc.yaml deps list that stage's modules."""
    if fresh_process:
        subprocess.run([sys.executable, "-m", module, *args], check=True, stdout=subprocess.DEVNULL)
        return
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]), contextlib.redirect_stdout(io.StringIO()):
            importlib.import_module(module).main(list(args))
    except SystemExit as stop:  # argparse's way out: 0 after --help, 2 for arguments it refuses
        if stop.code not in (0, None):
            raise RuntimeError(f"{module} {' '.join(args)}: exited with status {stop.code}") from stop
    finally:
        torch.set_num_threads(threads)
