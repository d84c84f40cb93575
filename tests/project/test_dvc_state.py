"""The DVC state depends on the commit alone, not on where the clone is: no absolute path in a tracked or DVC-hashed
output, dvc.lock as DVC wrote it (never edited by hand), and two clones in two folders sharing one DVC cache agree
on `dvc status`, the second restoring the first's stages from the run cache."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT

# an absolute path of a machine: the start of a POSIX path under a top-level folder a checkout or environment lives in
ABSOLUTE = re.compile(r"(?<![\w.~-])/(?:work|home|tmp|usr|opt|root|mnt|srv|var|private|Users)/[\w.-]+")
TRACKED_OUTPUTS = ("dvc.lock", "metrics", "plots", "report", "report.md", "models/pins.json", "timings.md")
CHEAP_STAGES = ("check_params", "convert_models", "prepare_data")  # seconds each on the tiny profile


def tracked(*paths: str, new: bool = False) -> list[Path]:
    """The files git tracks under `paths` (all with none); `new`: also those not yet added that it does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", *(["--others", "--exclude-standard"] if new else []),
                             "--", *paths], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in listed.split("\0") if name and name != ".venv"]


def absolute_paths(files: list[Path]) -> list[str]:
    """`file: path` for each absolute path in a text file of `files` (binary files are skipped)."""
    found = []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{path}: {match}" for match in ABSOLUTE.findall(text)]
    return found


def test_no_tracked_output_holds_an_absolute_path():
    assert absolute_paths(tracked(*TRACKED_OUTPUTS)) == []


def test_the_absolute_path_check_sees_one(tmp_path):
    (tmp_path / "config.yaml").write_text("include: /work/clone/.venv/lib/python3.11/site-packages/x.yaml\n")
    (tmp_path / "relative.yaml").write_text("include: ../../.venv/lib/x.yaml\nurl: https://example.org/home/x\n")
    assert absolute_paths([tmp_path / "config.yaml", tmp_path / "relative.yaml"]) == [
        f"{tmp_path / 'config.yaml'}: /work/clone"]


def lock_deps(lock: dict):
    for stage in lock["stages"].values():
        for dep in stage.get("deps", []) + stage.get("outs", []):
            yield dep


def test_dvc_lock_is_as_dvc_wrote_it_every_current_file_with_its_own_size():
    """A dep or output whose md5 is its file's now must have its file's size too: DVC writes both, a hand edit of
    the md5 alone leaves a stale size (before, nine deps did)."""
    stale = []
    for dep in lock_deps(yaml.safe_load((ROOT / "dvc.lock").read_text())):
        path = ROOT / dep["path"]
        if "md5" in dep and path.is_file() and hashlib.md5(path.read_bytes()).hexdigest() == dep["md5"]:
            if dep.get("size") != path.stat().st_size:
                stale.append(f"{dep['path']}: size {dep.get('size')} in dvc.lock, {path.stat().st_size} on disk")
    assert stale == []


def clone(source: Path, folder: Path, cache: Path) -> Path:
    """A git clone of `source` at `folder`, with its own .venv (this environment, linked) and the shared DVC
    `cache`."""
    subprocess.run(["git", "clone", "-q", str(source), str(folder)], check=True)
    (folder / ".venv").symlink_to(os.path.realpath(sys.prefix))
    dvc(folder, "config", "--local", "cache.dir", str(cache))
    return folder


def dvc(folder: Path, *args: str) -> str:
    """`dvc args` in `folder` as a user runs it there: the clone's own .venv first on PATH."""
    env = {**os.environ, "PATH": f"{folder / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "DVC_NO_ANALYTICS": "1", "PYTHONPATH": ""}
    done = subprocess.run([str(folder / ".venv" / "bin" / "dvc"), *args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, f"dvc {' '.join(args)} in {folder}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def committed_tree(tmp_path_factory) -> Path:
    """This working tree's files (as they are now: edits and files not yet added included) committed in a fresh
    repository: what a clone of the commit under test holds."""
    folder = tmp_path_factory.mktemp("origin") / "repo"
    for path in tracked(new=True):
        if path.is_file() and not path.is_symlink():
            (folder / path.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, folder / path.relative_to(ROOT))
    for command in (["init", "-q"], ["add", "-A"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"]):
        subprocess.run(["git", *command], cwd=folder, check=True)
    return folder


@pytest.mark.slow  # three cheap stages in one clone, restored in a second (about a minute)
def test_two_clones_in_two_folders_agree_on_dvc_status_and_the_second_restores_from_the_run_cache(
        committed_tree, tmp_path):
    cache = tmp_path / "dvc-cache"
    first = clone(committed_tree, tmp_path / "one" / "kv-handoff", cache)
    second = clone(committed_tree, tmp_path / "elsewhere" / "deeper" / "copy", cache)
    ran = dvc(first, "repro", CHEAP_STAGES[-1])
    # check_params' output is in git: with dvc.lock as DVC wrote it, it is up to date in a fresh clone
    assert "Stage 'check_params' didn't change, skipping" in ran, ran
    assert all(f"Running stage '{stage}'" in ran for stage in CHEAP_STAGES[1:]), ran
    outputs = [path for path in (first / "data").rglob("*") if path.is_file()]
    outputs += [first / "dvc.lock", first / "metrics" / "params_check.json",
                *(first / "models" / "converted").iterdir()]
    assert [found for found in absolute_paths(outputs) if str(tmp_path) in found] == []
    restored = dvc(second, "repro", CHEAP_STAGES[-1])
    for stage in CHEAP_STAGES[1:]:  # check_params keeps its output (persist), which DVC never restores
        assert f"Stage '{stage}' is cached - skipping run, checking out outputs" in restored, restored
        assert f"Running stage '{stage}'" not in restored, restored
    assert dvc(first, "status") == dvc(second, "status")
    assert (first / "dvc.lock").read_text() == (second / "dvc.lock").read_text()
