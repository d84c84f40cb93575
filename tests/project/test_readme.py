"""The README's `dvc` commands work as written from a plain shell (no `.venv/bin` on PATH): its code block
activates the environment DVC runs the stages with; and a stage started without it fails without costing
check_params' output."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.scratch import scratch_copy

README_LINE = "dvc repro -f check_params"
PLAIN_PATH = os.pathsep.join(folder for folder in ("/usr/local/bin", "/usr/bin", "/bin")
                             if Path(folder).resolve() != Path(sys.executable).parent.resolve())
CHECKED = "metrics/params_check.json"


def bash_blocks(text: str) -> list[list[str]]:
    """The lines of each ```bash block of a Markdown text."""
    return [block.splitlines() for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)]


def lines_up_to(line: str) -> list[str]:
    """The README block holding `line`, from its start through that line (what a user pastes)."""
    for block in bash_blocks((ROOT / "README.md").read_text()):
        for i, written in enumerate(block):
            if written.split("#")[0].strip() == line:
                return block[:i + 1]
    raise AssertionError(f"README.md has no bash block with the line {line!r}")


def plain_shell(script: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {"HOME": os.environ.get("HOME", str(cwd)), "PATH": PLAIN_PATH, "DVC_NO_ANALYTICS": "1", "LANG": "C.UTF-8"}
    return subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def project(tmp_path) -> Path:
    """A scratch copy of the repository with its own git history and `.venv` linked to this environment."""
    copy = tmp_path / "project"
    scratch_copy(ROOT, copy)
    (copy / ".venv").symlink_to(sys.prefix, target_is_directory=True)
    identity = ["-c", "user.name=t", "-c", "user.email=t@t"]
    for command in (["init", "-q"], ["add", "-A"], [*identity, "commit", "-qm", "scratch"]):
        subprocess.run(["git", *command], cwd=copy, check=True, capture_output=True)
    return copy


def test_the_readme_dvc_line_runs_its_stage_from_a_plain_shell(project):
    assert plain_shell("python -c 'import pipeline'", project).returncode != 0  # no pipeline without activating
    script = "\n".join(["set -e", *lines_up_to(README_LINE)])
    done = plain_shell(script, project)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Running stage 'check_params'" in done.stdout and '"valid": true' in done.stdout


def test_a_stage_run_without_the_environment_fails_and_check_params_keeps_its_output(project):
    before = (project / CHECKED).read_bytes()
    done = plain_shell(".venv/bin/" + README_LINE, project)
    assert done.returncode != 0 and "failed to reproduce 'check_params'" in done.stderr, done.stderr[-2000:]
    assert (project / CHECKED).read_bytes() == before
