"""The end-to-end tests' scratch copy (tests/helpers/scratch.py) holds every file a clone of HEAD holds, whatever a
failed or interrupted stage deleted or half-wrote in the workspace, and the workspace's own edits to the code."""
import subprocess

import pytest
from helpers import ROOT
from helpers.scratch import git_files, scratch_copy

DELETED = "metrics/controls_usage.json"  # what `dvc repro controls` deletes before it runs
HALF_WRITTEN = "models/pins.json"
EDITED = "pipeline/__init__.py"


@pytest.fixture
def workspace(tmp_path):
    """A clone of this repository's HEAD, as a user's workspace after a failed stage and an uncommitted edit."""
    clone = tmp_path / "workspace"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    (clone / DELETED).unlink()
    (clone / HALF_WRITTEN).write_text("{")
    (clone / EDITED).write_text((clone / EDITED).read_text() + "# an uncommitted edit\n")
    return clone


def test_the_scratch_copy_has_every_committed_file_after_a_stage_deleted_an_output(workspace, tmp_path):
    copy = tmp_path / "copy"
    scratch_copy(workspace, copy)
    missing = [name for name in git_files(workspace, "ls-tree", "-r", "--name-only", "HEAD")
               if not (copy / name).exists()]
    assert not missing, missing
    assert (copy / DELETED).read_bytes() == subprocess.run(["git", "show", f"HEAD:{DELETED}"], cwd=workspace,
                                                           capture_output=True, check=True).stdout


def test_the_scratch_copy_takes_outputs_from_head_and_the_code_from_the_working_tree(workspace, tmp_path):
    copy = tmp_path / "copy"
    from_head = scratch_copy(workspace, copy)
    assert {DELETED, HALF_WRITTEN, "dvc.lock"} <= set(from_head) and EDITED not in from_head
    assert (copy / HALF_WRITTEN).read_text() != "{"
    assert (copy / EDITED).read_text().endswith("# an uncommitted edit\n")
    assert not (copy / ".git").exists()


def test_a_copy_of_the_working_tree_alone_would_lack_the_deleted_output(workspace):
    assert DELETED in git_files(workspace, "ls-files") and not (workspace / DELETED).exists()
