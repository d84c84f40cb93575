"""The README's commands: each runs here as written from a plain shell (no `.venv/bin` on PATH) on the tiny
profile, or says in its comment that it is `illustrative` (and where it runs instead); the own-pair recipe's `-S`
list passes check_params; a stage started without the environment fails without costing check_params' output; and
every committed file the README and docs/ name is in the repository (a clone has nothing beside it)."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from dvc.utils.hydra import compose_and_dump
from helpers import ROOT
from helpers.scratch import scratch_copy

from pipeline.check_params import check
from pipeline.store.params import ParamError
from pipeline.store.shapes import shape_config

README_LINE = "dvc repro -f check_params"
DIFF_LINE = "dvc metrics diff main my-branch --targets metrics/headline"
RUN_HERE = {"source .venv/bin/activate", README_LINE, DIFF_LINE}  # the commands this file's tests run
MARK = "illustrative"  # a README command that says this word in its comment is not run here
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
    for command in (["init", "-q", "-b", "main"], ["add", "-A"], [*identity, "commit", "-qm", "scratch"]):
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


def unmarked_commands(text: str) -> set[str]:
    """The commands of a Markdown text's bash blocks whose comment does not start with the word `MARK`."""
    lines = [line for block in bash_blocks(text) for line in block if line.split("#")[0].strip()]
    return {line.split("#")[0].strip() for line in lines
            if re.match(rf"\s*{MARK}\b", line.partition("#")[2]) is None}


def test_every_readme_command_runs_in_a_test_here_or_says_it_is_illustrative():
    unmarked = unmarked_commands((ROOT / "README.md").read_text())
    assert unmarked == RUN_HERE, f"README commands neither run here nor marked {MARK!r}: {unmarked ^ RUN_HERE}"


def test_the_command_check_sees_an_unmarked_command():
    text = "```bash\nmake repro   # illustrative: elsewhere\ndvc gc -w   # cleans the cache, illustrative\n```\n"
    assert unmarked_commands(text) == {"dvc gc -w"}


COMMITTED = ("docs/", "report/", "pipeline/", "conf/", "tests/", "tools/", "metrics/", "plots/")  # git holds these


def missing_paths(text: str, root: Path) -> list[str]:
    """The paths a Markdown text names in backticks that leave the repository or name a committed file it lacks
    (a template such as `report/<profile>/` is not a path)."""
    named = (token.split("#")[0] for token in re.findall(r"`([^`\s<>*{}]+)`", text))
    return [path for path in named if path.startswith("../")
            or ((path.startswith(COMMITTED) or path.endswith(".md")) and not (root / path).exists())]


def test_every_file_the_readme_and_docs_name_is_in_the_repository():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert missing_paths(doc.read_text(), ROOT) == [], f"{doc.relative_to(ROOT)} names files a clone lacks"


def test_the_path_check_sees_a_path_outside_the_repository_and_a_missing_file():
    text = "See `../notes/protocol.md`, `docs/nowhere.md`, `report/<profile>/`, `docs/protocol.md` and `dvc repro`."
    assert missing_paths(text, ROOT) == ["../notes/protocol.md", "docs/nowhere.md"]


def test_the_readme_metrics_diff_shows_a_change_between_two_branches(project):
    identity = ["-c", "user.name=t", "-c", "user.email=t@t"]
    headline = project / "metrics/headline/selected.json"
    figures = json.loads(headline.read_text())
    figures["retention"] = 0.123456
    subprocess.run(["git", "checkout", "-q", "-b", "my-branch"], cwd=project, check=True)
    headline.write_text(json.dumps(figures, indent=2))
    subprocess.run(["git", *identity, "commit", "-qam", "a change"], cwd=project, check=True)
    script = "\n".join(["set -e", *lines_up_to("source .venv/bin/activate"), *lines_up_to(DIFF_LINE)[-1:]])
    done = plain_shell(script, project)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    changed = [line for line in done.stdout.splitlines() if "selected.json" in line and "retention " in line + " "]
    assert changed and "0.12346" in changed[0], done.stdout


def test_the_readme_own_pair_recipe_passes_check_params(tmp_path):
    lines = [line for block in bash_blocks((ROOT / "README.md").read_text()) for line in block]
    line = next(line.split("#")[0] for line in lines if "convert.target=null" in line)
    overrides = [word for word in shlex.split(line) if "=" in word and not word.startswith("-")]
    # an own pair outside the repository: Qwen2.5-Coder's configs with the tiny tokenizer (check_params reads configs
    # and tokenizers, never weights)
    for name, side, shape in (("/models/big", "target", "qwen2.5-coder-1.5b"), ("/models/small", "source",
                                                                                 "qwen2.5-coder-0.5b")):
        shutil.copytree(ROOT / "models/target", tmp_path / side, ignore=shutil.ignore_patterns("*.safetensors"))
        shape_config(shape).to_json_file(tmp_path / side / "config.json")
        overrides = [word.replace(name, str(tmp_path / side)) for word in overrides]
    out = tmp_path / "params.yaml"
    compose_and_dump(out, str(ROOT / "conf"), None, "config", "", overrides)
    params = yaml.safe_load(out.read_text())
    assert params["models"]["target"] == params["data"]["tokenizer"] == str(tmp_path / "target")
    check(params)
    params["data"]["tokenizer"] = "models/converted"  # the profile's own: not this target's
    with pytest.raises(ParamError, match=r"^data\.tokenizer: models/converted is not the target's tokenizer"):
        check(params)


def documented_sample(path: Path) -> tuple[str, list[str]]:
    """The `$ <command>` line of a Markdown file's generate sample and the output lines shown under it."""
    block = re.search(r"^```\n\$ (\.venv/bin/python -m pipeline\.generate[^\n]*)\n(.*?)^```", path.read_text(),
                      flags=re.S | re.M)
    return block.group(1), block.group(2).strip("\n").splitlines()


def untimed(lines: list[str]) -> list[str]:
    """Output lines with the time-to-first-token column of each table row masked."""
    return [re.sub(r"^(\| \w+ \| )[0-9.]+( \|)", r"\1#\2", line) for line in lines]


def test_the_documented_generate_sample_is_what_the_committed_tiny_pair_prints(project):
    command, shown = documented_sample(project / "docs/interfaces.md")
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PYTHONPATH": str(project)}
    prepared = subprocess.run([sys.executable, "-m", "pipeline.prepare_data"], cwd=project, env=env,
                              capture_output=True, text=True, timeout=300)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    words = shlex.split(command)
    done = subprocess.run([sys.executable, *words[1:]], cwd=project, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = done.stdout.strip("\n").splitlines()
    assert untimed(printed) == untimed(shown)


def test_the_sample_check_masks_only_the_time_column():
    rows = ["| oracle | 9.6 | 12 | same as oracle | oracle |", "oracle |  . Later 9.6"]
    assert untimed(rows) == ["| oracle | # | 12 | same as oracle | oracle |", "oracle |  . Later 9.6"]
