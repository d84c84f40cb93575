"""The command line every stage shares: `--help` that touches nothing, unknown arguments refused, a `Refusal` or a
missing file as one line `error: <sentence>` and status 2 (KVH_TRACEBACK=1: the traceback; any other exception is a
bug and keeps it), Ctrl-C or SIGTERM as `interrupted: <stage>` and status 130 or 143, only the first signal taken.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import importlib
import io
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

from pipeline.store.lazy import lazy

torch = lazy("torch")

TRACEBACK_ENV = "KVH_TRACEBACK"
# a waited-on process's status, as a shell reports it (128 + the signal: 130 for Ctrl-C, 143 for SIGTERM) -> signal
STOPPED_BY = {128 + signum: signum for signum in (signal.SIGINT, signal.SIGTERM)}
PR_SET_PDEATHSIG = 1  # prctl's option: the signal this process gets when its parent ends (linux/prctl.h)
SHELLS = frozenset({"sh", "dash", "bash", "zsh", "ksh", "fish"})  # `$SHELL -c <cmd>` between a launcher and a stage
LAUNCHER_POLL_S = 0.5  # how often a stage under a shell checks that the shell's launcher (dvc) still runs
PARENT_SAYS_ENV = "KVH_PARENT_SAYS_INTERRUPT"  # set for the processes a stage starts (`relaunch`, `run_stage`)


class Refusal(Exception):
    """An error that is the user's to fix (its message says how), not the code's."""


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def no_arguments(module: str, doc: str, argv: list[str] | None) -> None:
    """For a stage that takes no arguments: `--help` prints its docstring, anything else is refused."""
    parser(module, doc + "\nThis stage takes no arguments: it reads params.yaml.").parse_args(argv)


def entry(main: Callable[[list[str]], object]) -> None:
    """Run a stage's main(sys.argv[1:]): a refusal exits 2, Ctrl-C 130 and SIGTERM 143, each with one line. As the
    command itself (main in `__main__`) it skips the interpreter's teardown and ends when its parent does."""
    as_command = main.__module__ == "__main__"
    if as_command:
        atexit.register(_end_without_teardown)  # runs after the exit handlers registered while main runs
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)  # a `kill` or a scheduler's stop: the same cleanup as Ctrl-C
        _end_with_parent()
    try:
        main(sys.argv[1:])
    except KeyboardInterrupt:
        _stop_interrupted(_stage_name(main), as_command)
    except Exception as err:
        if _INTERRUPTED:  # e.g. a collective broken off because an interrupted peer left first
            _stop_interrupted(_stage_name(main), as_command)
        if not isinstance(err, (Refusal, FileNotFoundError)) or _traceback_asked():
            raise
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if as_command:
        _QUICK_EXIT.append(0)


_QUICK_EXIT: list[int] = []  # a command's main returned (0) or was interrupted: its exit may skip the teardown
_INTERRUPTED: list[int] = []  # the signal that interrupted this process's stage, once it came
_LAST_WORDS: list[str] = []  # the line an interrupted command ends with


def _traceback_asked() -> bool:
    return os.environ.get(TRACEBACK_ENV, "") not in ("", "0")


def _end_with_parent() -> None:
    """SIGTERM to this process when its parent ends, or when the `$SHELL -c` dvc runs it through is orphaned (a shell
    that does not exec it, as dash, outlives a killed dvc). Linux only."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    with contextlib.suppress(OSError):
        shell = os.getppid()
        with open(f"/proc/{shell}/comm") as comm:
            if comm.read().strip() in SHELLS:
                threading.Thread(target=_end_with_launcher, args=(shell, _parent_of(shell)), daemon=True).start()


def _parent_of(pid: int) -> int:
    """A process's parent, from /proc/<pid>/stat (`pid (name) state ppid ...`; the name may hold spaces)."""
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rpartition(")")[2].split()[1])


def _end_with_launcher(shell: int, launcher: int) -> None:
    while True:
        time.sleep(LAUNCHER_POLL_S)
        with contextlib.suppress(OSError):
            if _parent_of(shell) == launcher:
                continue
        os.kill(os.getpid(), signal.SIGTERM)
        return


def interrupted_by(signum: int) -> KeyboardInterrupt:
    """The interrupt to raise when a process this stage waited on was stopped by `signum` (its status the stage's)."""
    _INTERRUPTED.append(signum)
    return KeyboardInterrupt()


def _interrupt(signum: int, frame) -> None:
    """The first signal raises KeyboardInterrupt; later ones are ignored, so they cannot break off its cleanup."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _INTERRUPTED.append(signum)
    raise KeyboardInterrupt


def _stage_name(main: Callable) -> str:
    module = main.__module__
    if module == "__main__":
        spec = getattr(sys.modules["__main__"], "__spec__", None)  # None for a script run by its path
        module = spec.name if spec is not None else os.path.splitext(os.path.basename(sys.argv[0]))[0]
    return module.rpartition(".")[2]


def _stop_interrupted(stage: str, as_command: bool) -> None:
    """`interrupted: <stage>` from the one process that says it (neither a started process nor a rank but 0), then
    exit 128 + the signal (SIGINT where none came). KVH_TRACEBACK=1 re-raises instead."""
    if _traceback_asked():
        raise  # noqa: PLE0704 - called from an except block: the exception it handles goes on
    if PARENT_SAYS_ENV not in os.environ and os.environ.get("RANK", "0") == "0":
        if as_command:  # said last, after what the unwinding prints (a progress bar closed where it stopped)
            _LAST_WORDS.append(f"interrupted: {stage}")
        else:
            print(f"interrupted: {stage}", file=sys.stderr)
    status = 128 + (_INTERRUPTED[0] if _INTERRUPTED else signal.SIGINT)
    if as_command:
        _QUICK_EXIT.append(status)
    raise SystemExit(status) from None


def _end_without_teardown() -> None:
    """Flush and end a command whose main returned or was interrupted without the teardown of every module's objects:
    destroying torch's, transformers' and lm-eval's costs about a second per process, and after an interrupt includes
    a process group peers may have left. After a failure it returns: the usual exit follows."""
    if not _QUICK_EXIT:
        return
    logging.shutdown()
    with contextlib.suppress(OSError):  # a reader gone with a dead parent: the status still says it
        sys.stdout.flush()
        for line in _LAST_WORDS:
            print(line, file=sys.stderr)
        sys.stderr.flush()
    os._exit(_QUICK_EXIT[-1])


def run_stage(module: str, *args: str, fresh_process: bool = False) -> None:
    """Run another stage as `python -m <module> args...`, output silenced, in this process (keeping the caller's torch
    threads and random state) or with `fresh_process` a new interpreter. Name the module as a literal:
    tools/importgraph.py reads it for the caller's dvc.yaml deps."""
    if fresh_process:
        command = [sys.executable, "-m", module, *args]
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, env={**os.environ, PARENT_SAYS_ENV: "1"})
        try:
            status = child.wait()
        except KeyboardInterrupt:  # passed on, for a signal sent to this process alone (a terminal's reached both)
            child.send_signal(_INTERRUPTED[0] if _INTERRUPTED else signal.SIGINT)
            child.wait()
            raise
        if status in STOPPED_BY:  # a signal that reached it alone
            raise interrupted_by(STOPPED_BY[status])
        if status != 0:
            raise subprocess.CalledProcessError(status, command)
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
