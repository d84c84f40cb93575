"""Every stage's command line: `--help` prints usage and touches nothing, unknown arguments are refused, and
a refusal is one line on stderr (the traceback only with KVH_TRACEBACK=1)."""
import contextlib
import hashlib
import importlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil  # accelerate's dependency: a stage's processes
import pytest
import torch
import yaml
from helpers import ROOT
from helpers.dvc import dvc_stages

from pipeline import fit
from pipeline.store import cli

STAGES = sorted(dvc_stages(ROOT))


def tree_digest(root: Path) -> str:
    """Hash of every file git sees in the tree (tracked, and untracked but not ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256()
    for name in sorted(filter(None, listed.split("\0"))):
        path = root / name
        digest.update(name.encode() + (path.read_bytes() if path.is_file() else b"<gone>"))
    return digest.hexdigest()


@pytest.mark.parametrize("module", STAGES)
def test_help_prints_usage_and_changes_no_file(module, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    before = tree_digest(ROOT)
    with pytest.raises(SystemExit) as done:
        importlib.import_module(module).main(["--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m {module}")
    assert tree_digest(ROOT) == before


@pytest.mark.parametrize("module", STAGES)
def test_unknown_arguments_are_refused(module, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as done:
        importlib.import_module(module).main(["source", "--no-such-option"])
    assert done.value.code == 2
    assert "error:" in capsys.readouterr().err


def run_stage(module: str, cwd: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


@pytest.fixture
def typo(tmp_path) -> Path:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["select"]["horizn"] = params["select"].pop("horizon")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    return tmp_path


def test_a_refusal_is_one_line_naming_the_key(typo):
    done = run_stage("pipeline.select", typo)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: select.horizn: unknown parameter (known: prompt_fraction, prompt_lengths, continuation, top_k, "
        "horizon, rule, batch_size, processes, repairs, repair_maps, max_recompute, bound_pair, length, lookahead, "
        "lookahead_share)"]


def test_the_traceback_comes_when_asked(typo):
    done = run_stage("pipeline.select", typo, KVH_TRACEBACK="1")
    assert done.returncode == 1 and "Traceback (most recent call last)" in done.stderr
    assert "ParamError: select.horizn: unknown parameter" in done.stderr


def test_run_stage_runs_another_stages_own_command_and_stops_on_its_failure(monkeypatch):
    monkeypatch.chdir(ROOT)
    cli.run_stage("pipeline.fit", "--help")
    with pytest.raises(RuntimeError, match="pipeline.fit --no-such-option: exited with status 2"):
        cli.run_stage("pipeline.fit", "--no-such-option")
    cli.run_stage("pipeline.fit", "--help", fresh_process=True)
    with pytest.raises(subprocess.CalledProcessError):
        cli.run_stage("pipeline.fit", "--no-such-option", fresh_process=True)


def test_a_stage_run_in_this_process_keeps_the_callers_threads_and_random_state(monkeypatch):
    monkeypatch.chdir(ROOT)
    initial = torch.get_num_threads()
    torch.set_num_threads(1)
    before = torch.random.get_rng_state()
    monkeypatch.setattr(fit, "main", lambda argv: (torch.set_num_threads(2), torch.rand(3)))
    try:
        cli.run_stage("pipeline.fit", "--only", "x")
        assert torch.get_num_threads() == 1 and torch.equal(torch.random.get_rng_state(), before)
    finally:
        torch.set_num_threads(initial)


COMMAND = '''
import atexit
import os
import shutil
import signal
import sys
import time

from pipeline.store.artifacts import atomic_path
from pipeline.store.cli import Refusal, entry, run_stage


class Teardown:
    def __del__(self):
        print("teardown ran", file=sys.stderr)


LEFT_BEHIND = Teardown()  # a module global: only the interpreter's teardown destroys it


def main(argv):
    atexit.register(print, "; exit handler ran")
    sys.stdout.write("written, not flushed")
    if argv == ["refuse"]:
        raise Refusal("nothing to do")
    if argv == ["interrupt"]:
        try:
            with atomic_path("out.txt") as tmp:
                tmp.write_text("half")
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C mid-write
                time.sleep(60)
        finally:
            os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C while the first one's cleanup runs
            sys.stdout.write("; cleaned up")
    if argv == ["parent"]:
        run_stage("command", "child", fresh_process=True)
    if argv == ["child"]:
        with atomic_path("out.txt") as tmp:
            tmp.write_text("half")
            time.sleep(60)


if __name__ == "__main__":
    entry(main)
'''


def start_command(folder: Path, *argv: str) -> subprocess.Popen:
    """COMMAND run as a script in its own session, its standard output a pipe and block-buffered (as under DVC)."""
    (folder / "command.py").write_text(COMMAND)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    return subprocess.Popen([sys.executable, "command.py", *argv], cwd=folder, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**env, "PYTHONPATH": str(ROOT)})


def run_command(folder: Path, *argv: str) -> subprocess.CompletedProcess:
    command = start_command(folder, *argv)
    out, err = command.communicate(timeout=60)
    return subprocess.CompletedProcess(command.args, command.returncode, out, err)


def test_a_command_that_succeeds_skips_the_teardown_but_flushes_its_output_and_runs_its_exit_handlers(tmp_path):
    done = run_command(tmp_path)
    assert done.returncode == 0
    assert done.stdout == "written, not flushed; exit handler ran\n"
    assert "teardown ran" not in done.stderr


def test_a_command_that_fails_ends_as_usual_with_its_status(tmp_path):
    done = run_command(tmp_path, "refuse")
    assert done.returncode == 2
    assert done.stdout == "written, not flushed; exit handler ran\n"
    assert done.stderr.splitlines() == ["error: nothing to do", "teardown ran"]


def test_entry_called_from_another_module_returns(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pytest", "x"])
    seen = []
    cli.entry(seen.append)
    assert seen == [["x"]]


def test_ctrl_c_ends_a_command_with_one_line_and_status_130_after_its_cleanup_which_a_second_cannot_break(tmp_path):
    done = run_command(tmp_path, "interrupt")
    assert done.returncode == 130
    assert done.stderr.splitlines() == ["interrupted: command"]  # and no teardown: the process group may be broken
    assert done.stdout == "written, not flushed; cleaned up; exit handler ran\n"
    assert os.listdir(tmp_path) == ["command.py"]  # neither the output nor its temporary


def test_ctrl_c_on_a_stage_running_another_in_a_fresh_process_is_said_once_after_both_cleaned_up(tmp_path):
    command = start_command(tmp_path, "parent")
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".out.txt.*.tmp")):  # the child is writing its output
            assert command.poll() is None and time.monotonic() < deadline, command.communicate()
            time.sleep(0.05)
        os.killpg(command.pid, signal.SIGINT)  # Ctrl-C: the terminal signals its foreground process group
        out, err = command.communicate(timeout=60)
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
            command.wait()
    assert command.returncode == 130 and err.splitlines() == ["interrupted: command"]
    assert out == "written, not flushed; exit handler ran\n"
    assert [name for name in os.listdir(tmp_path) if name != "__pycache__"] == ["command.py"]


def _interrupted(argv):
    raise KeyboardInterrupt


def test_an_interrupt_is_one_line_naming_the_stage_and_status_130(monkeypatch, capsys):
    for name in ("RANK", cli.PARENT_SAYS_ENV, cli.TRACEBACK_ENV):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as stop:
        cli.entry(_interrupted)
    assert stop.value.code == 130 and capsys.readouterr().err == "interrupted: test_cli\n"


@pytest.mark.parametrize("env", [{"RANK": "1"}, {cli.PARENT_SAYS_ENV: "1"}], ids=["rank 1", "started by a stage"])
def test_of_several_processes_only_rank_0_says_an_interrupt_and_none_under_the_launcher_that_says_it(env, monkeypatch,
                                                                                                    capsys):
    monkeypatch.delenv(cli.TRACEBACK_ENV, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stop:
        cli.entry(_interrupted)
    assert stop.value.code == 130 and capsys.readouterr().err == ""


def test_an_interrupt_keeps_its_traceback_when_asked(monkeypatch):
    monkeypatch.setenv(cli.TRACEBACK_ENV, "1")
    with pytest.raises(KeyboardInterrupt):
        cli.entry(_interrupted)


def test_an_error_after_an_interrupt_such_as_a_collective_a_peer_left_is_the_interrupt(monkeypatch, capsys):
    for name in ("RANK", cli.PARENT_SAYS_ENV, cli.TRACEBACK_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cli, "_INTERRUPTED", [2])

    def peer_left(argv):
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(SystemExit) as stop:
        cli.entry(peer_left)
    assert stop.value.code == 130 and capsys.readouterr().err == "interrupted: test_cli\n"


def wait_for(condition, command: subprocess.Popen, what: str, limit: float = 60) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert command.poll() is None and time.monotonic() < deadline, f"{what} never came: {command.communicate()}"
        time.sleep(0.05)


def writing(folder: Path) -> bool:
    return bool(list(folder.glob(".out.txt.*.tmp")))


@pytest.mark.parametrize("argv", [["child"], ["parent"]], ids=["a stage", "a stage waiting on its fresh process"])
def test_sigterm_ends_a_command_with_one_line_and_status_143_after_its_cleanup(argv, tmp_path):
    command = start_command(tmp_path, *argv)
    try:
        wait_for(lambda: writing(tmp_path), command, "the output's temporary")
        command.send_signal(signal.SIGTERM)  # to the stage alone: one that waits on another passes it on
        out, err = command.communicate(timeout=30)
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
            command.wait()
    assert command.returncode == 143 and err.splitlines() == ["interrupted: command"]  # before, 130
    assert out == "written, not flushed; exit handler ran\n"
    assert [name for name in os.listdir(tmp_path) if name != "__pycache__"] == ["command.py"]


def test_a_command_whose_parent_is_killed_outright_ends_cleaned_up(tmp_path):
    command = start_command(tmp_path, "parent")
    try:
        wait_for(lambda: writing(tmp_path), command, "the fresh process's temporary")
        (child,) = psutil.Process(command.pid).children()
        command.kill()  # SIGKILL: nothing of the parent's runs; the kernel tells the child (PR_SET_PDEATHSIG)
        command.wait()
        _, alive = psutil.wait_procs([child], timeout=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(command.pid, signal.SIGKILL)
    assert not alive, "the stage's fresh process outlived its killed parent (before: 60 s more, writing)"
    assert [name for name in os.listdir(tmp_path) if name != "__pycache__"] == ["command.py"]


DVC_YAML = """stages:
  command:
    cmd: python command.py child
    outs:
      - out.txt: {cache: false, persist: true}
"""


@pytest.mark.parametrize("shell", ["dash", "bash"])  # dvc runs `$SHELL -c cmd`: dash keeps itself in between
@pytest.mark.parametrize("stop", ["dvc", "its process group"])
def test_sigterm_to_dvc_repro_ends_its_stage_cleaned_up_and_a_persisted_output_kept(stop, shell, tmp_path):
    (tmp_path / "command.py").write_text(COMMAND)
    (tmp_path / "dvc.yaml").write_text(DVC_YAML)
    (tmp_path / "out.txt").write_text("committed")
    env = {**{key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"},
           "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "DVC_NO_ANALYTICS": "1", "SHELL": shutil.which(shell)}
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=tmp_path, env=env, check=True)
    dvc = subprocess.Popen([sys.executable, "-m", "dvc", "repro"], cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        wait_for(lambda: writing(tmp_path), dvc, "the stage's temporary")
        stage = [process for process in psutil.Process(dvc.pid).children(recursive=True)
                 if "command.py" in process.cmdline()]
        (os.kill if stop == "dvc" else os.killpg)(dvc.pid, signal.SIGTERM)
        _, err = dvc.communicate(timeout=30)  # the stage's stderr is dvc's: its end comes when the stage ends
        _, alive = psutil.wait_procs(stage, timeout=10)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(dvc.pid, signal.SIGKILL)
    assert len(stage) == 1 and not alive, "the stage outlived dvc"
    assert err.splitlines()[-1] == "interrupted: command", err  # its SIGTERM handler ran: cleaned up
    assert (tmp_path / "out.txt").read_text() == "committed"  # persist: dvc did not delete it before the run
    assert not list(tmp_path.glob(".*.tmp"))
