"""The house rules of pipeline/: stages at the top import wings; wings never import a stage or the lm-eval
face; inside the wings imports only go down the one order `pipeline.WINGS` declares; no cycle, no import
hidden in a function. Checked from source on the real tree, and shown to catch each breach on a fake one."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml
from importgraph import cycle, edges, graph, modules, stage_module

from pipeline import STAGES, WINGS

ROOT = Path(__file__).resolve().parents[1]
CHECKER = "pipeline.check_params"  # the one stage that reads the others' Params classes, to validate them all


def dvc_stages(root: Path) -> set[str]:
    """Stage modules: the `python -m pipeline.<module>` of each dvc.yaml stage."""
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    return {stage_module(stage) for stage in stages.values()}


def violations(root: Path, stages: set[str], wings: dict[str, tuple[str, ...]]) -> list[str]:
    known = modules(root)
    order = [f"pipeline.{wing}.{name}" for wing, names in wings.items() for name in names]
    rank = {name: i for i, name in enumerate(order)}
    found = []
    for wing, names in wings.items():
        present = {p.stem for p in (root / "pipeline" / wing).glob("*.py") if p.name != "__init__.py"}
        if present != set(names):
            found.append(f"wing {wing}: files {sorted(present)} but pipeline.WINGS lists {sorted(names)}")
        init = root / "pipeline" / wing / "__init__.py"
        if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(ast.parse(init.read_text()))):
            found.append(f"{init.relative_to(root)}: a wing's __init__ holds its docstring only, no imports")
    top = {name for name in known if name.count(".") == 1}
    for name, path in known.items():
        for target, line, inside in edges(path, known)["import"]:
            where = f"{path.relative_to(root)}:{line}"
            if inside:
                found.append(f"{where}: imports {target} inside a function (a hidden dependency)")
            if name in rank and target in top:
                found.append(f"{where}: wing module {name} imports {target}, which is not a wing")
            elif name in rank and rank.get(target, -1) >= rank[name]:
                found.append(f"{where}: {name} imports {target}, which is not before it in pipeline.WINGS")
            elif name in stages and target in stages and name != CHECKER:
                found.append(f"{where}: stage {name} imports stage {target}")
    loop = cycle(graph(root))
    if loop:
        found.append("import cycle: " + " -> ".join(loop))
    return found


def test_the_real_tree_keeps_the_house_rules():
    assert violations(ROOT, dvc_stages(ROOT), WINGS) == []


def test_every_top_level_module_is_a_stage_the_lm_eval_face_or_a_user_tool():
    top = {name for name in modules(ROOT) if name.count(".") == 1}
    assert top - dvc_stages(ROOT) == {"pipeline.lm_eval_model", "pipeline.check_pair", "pipeline.generate"}



def stages_in_order(root: Path) -> list[str]:
    """The stage modules of dvc.yaml in the order its entries stand, each once."""
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"].values()
    return list(dict.fromkeys(stage_module(stage).removeprefix("pipeline.") for stage in stages))


def test_the_package_map_lists_every_dvc_stage_in_dvc_yamls_order():
    assert list(STAGES) == stages_in_order(ROOT)


def test_the_package_map_check_sees_a_stage_missing_from_the_map(tmp_path):
    recipe = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    recipe["stages"]["extra"] = {"cmd": "python -m pipeline.extra_stage"}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert list(STAGES) != stages_in_order(tmp_path)
    assert stages_in_order(tmp_path)[-1] == "extra_stage"

@pytest.fixture
def fake(tmp_path):
    """A tree that keeps the rules: wings a < b, a stage s importing b.top."""
    files = {"pipeline/__init__.py": "", "pipeline/s.py": "from pipeline.b.top import f\n",
             "pipeline/t.py": "", "pipeline/a/__init__.py": '"""a."""\n', "pipeline/a/low.py": "",
             "pipeline/a/high.py": "from pipeline.a import low\n", "pipeline/b/__init__.py": "",
             "pipeline/b/top.py": "from pipeline.a.high import g\n\n\ndef f():\n    return g\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    def check(**edits) -> list[str]:
        for name, text in edits.items():
            (tmp_path / name).write_text(text)
        return violations(tmp_path, {"pipeline.s", "pipeline.t"}, {"a": ("low", "high"), "b": ("top",)})
    return check


def test_the_fake_tree_passes(fake):
    assert fake() == []


@pytest.mark.parametrize("edits, message", [
    ({"pipeline/a/low.py": "from pipeline import s\n"}, "wing module pipeline.a.low imports pipeline.s"),
    ({"pipeline/a/low.py": "from pipeline.a.high import g\n"},
     "pipeline.a.low imports pipeline.a.high, which is not before"),
    ({"pipeline/a/high.py": "import pipeline.b.top\n"}, "pipeline.a.high imports pipeline.b.top, which is not before"),
    ({"pipeline/s.py": "from pipeline.t import x\n"}, "stage pipeline.s imports stage pipeline.t"),
    ({"pipeline/s.py": "def f():\n    from pipeline.a import low\n"}, "imports pipeline.a.low inside a function"),
    ({"pipeline/a/low.py": 'high = lazy("pipeline.a.high")\n'},
     "pipeline.a.low imports pipeline.a.high, which is not before"),
    ({"pipeline/s.py": 'def f():\n    return lazy("pipeline.a.low")\n'}, "imports pipeline.a.low inside a function"),
    ({"pipeline/s.py": "from pipeline.t import x\n", "pipeline/t.py": "from pipeline import s\n"}, "import cycle"),
    ({"pipeline/a/extra.py": ""}, "wing a: files"),
    ({"pipeline/a/__init__.py": "from pipeline.a import low\n"}, "holds its docstring only"),
])
def test_each_breach_is_named(fake, edits, message):
    assert any(message in v for v in fake(**edits)), fake(**edits)


MAX_FUNCTION_LINES, MAX_MODULE_LINES = 60, 400
# functions over the limit that another branch splits; the merge empties this list
LONG_FUNCTIONS_BEING_SPLIT = {"pipeline/fit.py:run"}


def too_long(root: Path) -> list[str]:
    """Every function of pipeline/ over MAX_FUNCTION_LINES (decorators not counted) and every module over
    MAX_MODULE_LINES, as `path:name (lines)`."""
    found = []
    for path in sorted((root / "pipeline").rglob("*.py")):
        name, text = str(path.relative_to(root)), path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{name} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and f"{name}:{node.name}" not in LONG_FUNCTIONS_BEING_SPLIT:
                    found.append(f"{name}:{node.name} ({length} lines)")
    return found


def test_every_function_fits_a_screen_and_every_module_holds_one_idea():
    assert too_long(ROOT) == []


def test_the_length_check_sees_a_long_function_and_a_long_module(tmp_path):
    (tmp_path / "pipeline").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "pipeline" / "long.py").write_text(f"def f():\n{body}" + "\n" * MAX_MODULE_LINES)
    assert too_long(tmp_path) == [f"pipeline/long.py ({MAX_FUNCTION_LINES + 1 + MAX_MODULE_LINES} lines)",
                                  f"pipeline/long.py:f ({MAX_FUNCTION_LINES + 1} lines)"]
