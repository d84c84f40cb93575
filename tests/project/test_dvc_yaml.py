"""dvc.yaml lists, for every stage, the stage's module, its schema, the stages it runs and every wing it imports
(transitively, counting `python -m pipeline.X` subprocesses as imports) as one folder, so a code change reruns every
stage it can affect; DVC hashes those folders without the bytecode Python writes in them; every params section a
stage loads is declared in its `params:`; and the report, which only names modes, baselines, repair settings and
scores, imports no registry's maths (`kv/<registry>/maths/`)."""
import ast
import shutil
from pathlib import Path

import pytest
import stagedeps
import yaml
from helpers import ROOT
from importgraph import body, closure, edges, graph, modules, stage_module
from ruamel.yaml import YAML
from stagedeps import COMMAND, code_dep, needed_deps, rewritten, stale

STAGES = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def test_every_stage_depends_on_its_modules_and_the_wings_they_import():
    diff = stale(ROOT)
    assert not diff, f"dvc.yaml's stage deps differ from the imports; run `{COMMAND}`:\n{diff}"


def test_a_module_is_a_dep_as_its_file_at_the_top_or_in_schema_and_else_as_its_wings_folder():
    assert code_dep("pipeline/evaluate.py") == "pipeline/evaluate.py"
    assert code_dep("pipeline/schema/evaluate.py") == "pipeline/schema/evaluate.py"
    assert code_dep("pipeline/kv/rope.py") == "pipeline/kv"
    assert code_dep("pipeline/studies/format.py") == "pipeline/studies"


@pytest.fixture
def real_project(tmp_path):
    """dvc.yaml and pipeline/ copied, for a test to edit."""
    shutil.copytree(ROOT / "pipeline", tmp_path / "pipeline", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    return tmp_path


def test_the_check_fails_when_a_stage_imports_a_wing_its_deps_do_not_list(real_project):
    assert "pipeline/tiny" not in STAGES["report"]["deps"]
    report = real_project / "pipeline" / "report.py"
    report.write_text(report.read_text() + "from pipeline.tiny import world  # the edit\n")
    assert stale(real_project).count("\n+      - pipeline/tiny\n") == 1


def test_the_check_fails_when_a_wing_a_stage_imports_is_taken_out_of_its_deps(real_project):
    text = (real_project / "dvc.yaml").read_text()
    report = text.index("\n  report:")
    (real_project / "dvc.yaml").write_text(text[:report] + text[report:].replace("      - pipeline/studies\n", "", 1))
    assert stale(real_project).count("\n+      - pipeline/studies\n") == 1


def test_an_import_inside_a_wing_the_stage_lists_leaves_its_deps_as_they_are(real_project):
    report = real_project / "pipeline" / "report.py"
    report.write_text(report.read_text() + "from pipeline.kv.selectors import SELECTORS  # the edit\n")
    assert stale(real_project) == ""  # coarser than the modules: the report reruns on any edit of kv already


def test_dvc_hashes_a_wing_folder_without_the_bytecode_python_writes_in_it():
    from dvc.repo import Repo

    with Repo(str(ROOT)) as repo:
        ignored = [repo.dvcignore.is_ignored(repo.fs, str(ROOT / path)) for path in
                   ("pipeline/kv/__pycache__/rope.cpython-312.pyc", "pipeline/kv/modes.pyc",
                    "pipeline/kv/rope.py", "pipeline/store/configs/qwen3-0.6b.json")]
    assert ignored == [True, True, False, False]


STALE = """\
# a comment kept
stages:
  one:  # its comment kept
    cmd: python -m pipeline.one
    deps:
      - data/first.parquet
      - pipeline/one.py  # the stage itself
      - pipeline/gone.py
      - models/${item}
    params:
      - one
  two:
    foreach: [a, b]
    do:
      cmd: python -m pipeline.two ${item}
      deps:
        - data/${item}.parquet
        # code (make deps): the pipeline/ modules the command imports
        - pipeline/two.py
        - pipeline/wing/helper.py
      outs:
        - out/${item}
  three:
    cmd: python -m pipeline.helper
plots:
  - metrics/x.csv
"""
FRESH = """\
# a comment kept
stages:
  one:  # its comment kept
    cmd: python -m pipeline.one
    params:
      - one
    deps:
      - data/first.parquet
      - models/${item}
      # code (make deps): the modules the command runs and the wings they import
      - pipeline/one.py  # the stage itself
      - pipeline/schema/one.py
      - pipeline/helper.py
      - pipeline/wing
  two:
    foreach: [a, b]
    do:
      cmd: python -m pipeline.two ${item}
      outs:
        - out/${item}
      deps:
        - data/${item}.parquet
        # code (make deps): the modules the command runs and the wings they import
        - pipeline/two.py
        - pipeline/wing
  three:
    cmd: python -m pipeline.helper
    deps:
      # code (make deps): the modules the command runs and the wings they import
      - pipeline/helper.py
plots:
  - metrics/x.csv
"""


@pytest.fixture
def stale_project(tmp_path):
    files = {"one.py": "from pipeline.wing import helper\nfrom pipeline.schema import one\nimport pipeline.helper\n",
             "two.py": "import pipeline.wing.helper\n", "helper.py": "", "schema/one.py": "",
             "wing/helper.py": "from pipeline.wing.sub import deep\n", "wing/sub/deep.py": ""}
    for name, text in files.items():
        (tmp_path / "pipeline" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pipeline" / name).write_text(text)
    (tmp_path / "dvc.yaml").write_text(STALE)
    return tmp_path


def test_make_deps_orders_each_stage_cmd_params_outs_deps_with_the_code_last_keeping_comments_and_data(
        stale_project):
    assert rewritten(STALE, needed_deps(stale_project)) == FRESH


def test_make_deps_is_idempotent_and_the_check_is_empty_after_it(stale_project):
    assert "-      - pipeline/gone.py" in stale(stale_project)
    (stale_project / "dvc.yaml").write_text(rewritten(STALE, needed_deps(stale_project)))
    assert stale(stale_project) == ""
    assert rewritten(FRESH, needed_deps(stale_project)) == FRESH


def test_the_stale_deps_check_prints_the_diff_and_names_make_deps(monkeypatch, capsys, stale_project):
    monkeypatch.setattr(stagedeps, "ROOT", stale_project)
    assert stagedeps.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert "\n+        - pipeline/wing\n" in out and out.rstrip().endswith("run `make deps`")
    assert stagedeps.main([]) == 0 and (stale_project / "dvc.yaml").read_text() == FRESH
    assert stagedeps.main(["--check"]) == 0


def test_every_stage_of_dvc_yaml_reads_cmd_params_outs_then_deps_with_its_code_last():
    text = (ROOT / "dvc.yaml").read_text()
    for name, stage in STAGES.items():
        stage = stage.get("do", stage)
        keys = [key for key in stage if key in stagedeps.ORDER]
        assert keys == sorted(keys, key=stagedeps.ORDER.get), (name, keys)
        code = [dep for dep in stage["deps"] if str(dep).startswith("pipeline/")]
        assert stage["deps"][-len(code):] == code, name  # the data first
    assert text.count(stagedeps.CODE) == len(STAGES)


def test_the_controls_refit_counts_as_an_import_of_the_fit_stage():
    assert "pipeline.fit" in closure("pipeline.controls", graph(ROOT, subprocess=True))
    assert "pipeline.fit" not in closure("pipeline.controls", graph(ROOT))


def test_a_stage_run_through_store_clis_run_stage_counts_as_an_import_of_it():
    for study in ("pipeline.calibrate", "pipeline.length"):  # extract and fit, in a scratch folder
        assert {"pipeline.extract", "pipeline.fit"} <= closure(study, graph(ROOT, subprocess=True))
        assert "pipeline.extract" not in closure(study, graph(ROOT))
    assert "pipeline.extract" not in closure("pipeline.controls", graph(ROOT, subprocess=True))


def test_a_lazy_reference_counts_as_an_import():
    # measure.taskeval: adapter = lazy("pipeline.measure.adapter")
    assert "pipeline.measure.adapter" in closure("pipeline.evaluate", graph(ROOT))


def test_every_stage_run_in_a_subprocess_or_lazy_module_is_named_by_a_literal():
    known = modules(ROOT)
    unnamed = [f"{path.relative_to(ROOT)}:{line}" for path in known.values() for _, line, _ in
               edges(path, known)["unnamed"]]
    assert not unnamed, f"run_stage or lazy called with a module name the dvc.yaml deps cannot read: {unnamed}"


def test_a_lazy_reference_the_deps_cannot_read_is_named(tmp_path):
    path = tmp_path / "pipeline" / "s.py"
    path.parent.mkdir()
    path.write_text('a = lazy(NAME)\nb = lazy("pipeline.nowhere")\nc = lazy("torch")\n')
    assert edges(path, modules(tmp_path))["unnamed"] == [("?", 1, False), ("pipeline.nowhere", 2, False)]


def sections_read(path: Path) -> set[str]:
    """Params keys a module reads: the string argument of load_section(..., "x"), load_value(..., "x") and
    read_key("x")."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if node.func.id in ("load_section", "load_value") and args:
                found.add(args[-1])
            elif node.func.id == "read_key" and args:
                found.add(args[0])
            elif node.func.id == "read_params":
                found.add("<everything>")
    return found


def declared(key: str, params: list) -> bool:
    """`key` is declared when it, a section above it or keys below it are listed."""
    if any(isinstance(p, dict) and "params.yaml" in p and not p["params.yaml"] for p in params):
        return True  # `- params.yaml:` with no keys: every parameter of the file
    names = [p for p in params if isinstance(p, str)]
    return key != "<everything>" and any(key == p or key.startswith(p + ".") or p.startswith(key + ".") for p in names)


def test_every_params_section_a_stage_reads_is_declared():
    for name, stage in STAGES.items():
        module = stage_module(stage)
        path = ROOT / (module.replace(".", "/") + ".py")
        params = body(stage).get("params", [])
        for key in sections_read(path):
            assert declared(key, params), f"stage {name} reads params {key!r} but dvc.yaml does not declare it"


def test_every_table_plot_names_its_x_and_y():
    entries = [entry for stage in STAGES.values() for entry in body(stage).get("plots", [])]
    for entry in entries:
        (path, options), = entry.items() if isinstance(entry, dict) else ((entry, {}),)
        if path.endswith(".csv"):
            assert options.get("x") and options.get("y"), f"plot {path} lacks x or y"


def test_dvc_reads_its_yaml_files_with_ruamels_c_parser():
    # DVC loads dvc.yaml, dvc.lock and params.yaml with ruamel's safe loader around every stage; without
    # ruamel.yaml.clib (a dependency of pyproject.toml) that loader is pure Python, about a second per stage here
    assert YAML(typ="safe").Parser.__module__.startswith("ruamel.yaml.clib")


def test_the_committed_pair_is_kept_by_dvc_while_prepare_models_makes_the_next_one():
    # dvc deletes a stage's outputs before it runs unless they persist: an interrupted prepare_models then lost the
    # pair git holds; the stage swaps both folders in itself once complete (store.artifacts.atomic_dirs)
    outs = {path: options for entry in STAGES["prepare_models"]["outs"] for path, options in entry.items()}
    assert set(outs) == {"models/source", "models/target"}
    assert all(options.get("persist") is True and options.get("cache") is False for options in outs.values()), outs


def test_every_stage_that_checks_the_controls_depends_on_their_verdict_and_none_on_their_figures():
    # controls.json's figures move from run to run: a stage that depended on them was never restored from the run cache
    assert {"metrics/controls_verdict.json": {"cache": False}} in STAGES["controls"]["metrics"]
    checking = []
    for name, stage in STAGES.items():
        deps = body(stage).get("deps", [])
        if name != "report":  # it shows the controls' figures
            assert "metrics/controls.json" not in deps, f"stage {name} depends on the controls' figures"
        if "require_controls_passed(" in (ROOT / (stage_module(stage).replace(".", "/") + ".py")).read_text():
            checking.append(name)
            assert "metrics/controls_verdict.json" in deps, f"stage {name} reads the verdict but does not depend on it"
    assert "evaluate_mapped" in checking and len(checking) == 7
