"""A scratch copy of the repository for end-to-end tests, independent of the workspace's stage outputs.

DVC deletes a stage's outputs before running it, so after a failed or interrupted stage the workspace lacks
tracked files (or holds ones the last commit does not): a copy of the working tree would break the tests, not
the stage. So the copy takes what DVC writes (every stage output dvc.yaml declares, and dvc.lock) from HEAD, as a
fresh clone has them, and everything else git tracks from the working tree, uncommitted edits included (the
code and configuration under test).
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

LOCK = "dvc.lock"


def git_files(root: Path, *args: str) -> list[str]:
    listed = subprocess.run(["git", *args, "-z"], cwd=root, capture_output=True, text=True, check=True).stdout
    return [name for name in listed.split("\0") if name]


def stage_outputs(root: Path) -> list[str]:
    """Every output path of dvc.yaml's stages (foreach stages expanded), relative to root."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return sorted({out.def_path for out in repo.index.outs})


def _under(name: str, paths: list[str]) -> bool:
    return any(name == path or name.startswith(path + "/") for path in paths)


def scratch_copy(root: Path, into: Path) -> list[str]:
    """Copy the repository at `root` into `into` (no .git): stage outputs and dvc.lock as HEAD has them, every
    other tracked file from the working tree (one deleted there is left out). Returns the files taken from HEAD."""
    written = [LOCK, *stage_outputs(root)]
    from_head = [name for name in git_files(root, "ls-tree", "-r", "--name-only", "HEAD") if _under(name, written)]
    for name in git_files(root, "ls-files"):
        source = root / name
        if not _under(name, written) and (source.is_file() or source.is_symlink()):
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name, follow_symlinks=False)
    if from_head:
        archive = subprocess.run(["git", "archive", "--format=tar", "HEAD", "--", *from_head], cwd=root,
                                 capture_output=True, check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(into, filter="data")
    return from_head


def run_edited(root: Path, into: Path, edits: dict[str, list[tuple[str, str]]], script: str) -> str:
    """`script` run by Python in a copy of `root`'s pipeline/ and tests/helpers/ (and params.yaml) under `into`, with
    `edits` (file -> (old, new) replacements, each old text found once) applied first: what adding a registry entry
    in one file does, shown without touching the workspace. Returns its stdout; a failure fails with its stderr."""
    for folder in ("pipeline", "tests/helpers"):
        shutil.copytree(root / folder, into / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(root / "params.yaml", into)
    for name, replacements in edits.items():
        text = (into / name).read_text()
        for old, new in replacements:
            assert text.count(old) == 1, f"{name}: {old!r} found {text.count(old)} times"
            text = text.replace(old, new)
        (into / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": f"{into}{os.pathsep}{into / 'tests'}"}
    run = subprocess.run([sys.executable, "-c", script], cwd=into, capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout
