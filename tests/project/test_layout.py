"""The house rules of pipeline/: stages at the top import wings; wings never import a stage or the lm-eval
face; inside the wings imports only go down the one order `pipeline.WINGS` declares; no cycle, no import
hidden in a function. Checked from source on the real tree, and shown to catch each breach on a fake one."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml
from helpers import ROOT
from helpers.dvc import dvc_stages
from importgraph import cycle, edges, graph, modules, stage_module

from pipeline import STAGES, WINGS


def violations(root: Path, stages: set[str], wings: dict[str, tuple[str, ...]]) -> list[str]:
    known = modules(root)
    order = [f"pipeline.{wing}.{name}" for wing, names in wings.items() for name in names]
    rank = {name: i for i, name in enumerate(order)}
    # a sub-package named in WINGS (`package.module`): its modules stand at
    # its place and import each other freely (the cycle check below still holds between them)

    def package(module: str) -> str | None:
        return module.rsplit(".", 1)[0] if module.rsplit(".", 1)[0] in rank else None

    def place(module: str) -> int:
        return rank.get(module, rank.get(package(module) or "", -1))

    found = []
    for wing, names in wings.items():
        folder = root / "pipeline" / wing
        present = ({p.stem for p in folder.glob("*.py") if p.name != "__init__.py"}
                   | {".".join(p.parent.relative_to(folder).parts) for p in folder.glob("*/**/__init__.py")})
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
            if place(name) >= 0 and target in top:
                found.append(f"{where}: wing module {name} imports {target}, which is not a wing")
            elif place(name) >= 0 and place(target) >= place(name) and not (package(name) and
                                                                          package(name) == package(target)):
                found.append(f"{where}: {name} imports {target}, which is not before it in pipeline.WINGS")
            elif name in stages and target in stages:
                found.append(f"{where}: stage {name} imports stage {target}")
    loop = cycle(graph(root))
    if loop:
        found.append("import cycle: " + " -> ".join(loop))
    return found


def test_the_real_tree_keeps_the_house_rules():
    assert violations(ROOT, dvc_stages(ROOT), WINGS) == []


def test_every_top_level_module_is_a_stage_the_lm_eval_face_or_a_user_tool():
    top = {name for name in modules(ROOT) if name.count(".") == 1}
    assert top - dvc_stages(ROOT) == {"pipeline.lm_eval_model", "pipeline.check_pair", "pipeline.generate",
                                      "pipeline.api"}


def handoffs_built_by_hand(root: Path) -> list[str]:
    """Every call in a top-level module of pipeline/ (a stage, a face, a user tool) that builds a handoff or a router
    other than through a request (`<pair>.router(...)`, or a `kv.request.Transfer` then `Router.of`):
    `<pair>.handoff(...)`, `Handoff(...)`, `Router(...)`, as `path:line`."""
    found = []
    for path in sorted((root / "pipeline").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if (isinstance(func, ast.Attribute) and func.attr == "handoff") or \
                    (isinstance(func, ast.Name) and func.id in ("Handoff", "Router")):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_every_stage_and_face_asks_for_its_handoffs_through_a_request_and_a_router():
    assert handoffs_built_by_hand(ROOT) == []


@pytest.mark.parametrize("call", ['pair.handoff("oracle")', 'Router(handoff)', 'Handoff(model)'])
def test_the_request_check_sees_a_handoff_built_by_hand(tmp_path, call):
    (tmp_path / "pipeline" / "kv").mkdir(parents=True)
    asked = 'router = pair.router(mode="oracle")\nhandoff = router.handoff\n'
    (tmp_path / "pipeline" / "stage.py").write_text(asked + f"x = {call}\n")
    (tmp_path / "pipeline" / "kv" / "pair.py").write_text(f"x = {call}\n")  # a wing builds handoffs freely
    assert handoffs_built_by_hand(tmp_path) == ["pipeline/stage.py:3"]


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
    """A tree that keeps the rules: wings a < b, a stage s importing b.top; a's sub-package fam between low and
    high, whose modules import each other and low, and fam's own sub-package fam.deep after fam, which imports fam."""
    files = {"pipeline/__init__.py": "", "pipeline/s.py": "from pipeline.b.top import f\n",
             "pipeline/t.py": "", "pipeline/a/__init__.py": '"""a."""\n', "pipeline/a/low.py": "",
             "pipeline/a/fam/__init__.py": "", "pipeline/a/fam/base.py": "from pipeline.a import low\n",
             "pipeline/a/fam/one.py": "from pipeline.a.fam import base\n",
             "pipeline/a/fam/deep/__init__.py": "", "pipeline/a/fam/deep/two.py": "from pipeline.a.fam import one\n",
             "pipeline/a/high.py": ("from pipeline.a import low\nfrom pipeline.a.fam import one\n"
                                    "from pipeline.a.fam.deep import two\n"),
             "pipeline/b/__init__.py": "",
             "pipeline/b/top.py": "from pipeline.a.high import g\n\n\ndef f():\n    return g\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    def check(**edits) -> list[str]:
        for name, text in edits.items():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(text)
        return violations(tmp_path, {"pipeline.s", "pipeline.t"}, {"a": ("low", "fam", "fam.deep", "high"),
                                                                    "b": ("top",)})
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
    ({"pipeline/a/fam/one.py": "from pipeline.a import high\n"},
     "pipeline.a.fam.one imports pipeline.a.high, which is not before"),
    ({"pipeline/a/low.py": "from pipeline.a.fam import one\n"},
     "pipeline.a.low imports pipeline.a.fam.one, which is not before"),
    ({"pipeline/a/fam/base.py": "from pipeline.a.fam import one\n"}, "import cycle"),
    ({"pipeline/a/fam/one.py": "from pipeline.a.fam.deep import two\n"},
     "pipeline.a.fam.one imports pipeline.a.fam.deep.two, which is not before"),
    ({"pipeline/a/fam/other/__init__.py": ""}, "wing a: files"),
    ({"pipeline/a/__init__.py": "from pipeline.a import low\n"}, "holds its docstring only"),
])
def test_each_breach_is_named(fake, edits, message):
    assert any(message in v for v in fake(**edits)), fake(**edits)


SHARED = ("models", "eval", "metrics", "caches")  # the folders stages hand files through


def path_literals(root: Path) -> list[str]:
    """Path literals under the shared folders outside store/paths.py (the one place their files are named): a
    string starting `models/` (docstrings aside), `Path("eval")`, or a `/` join with "metrics" or "caches"."""
    shared = re.compile(r"^(%s)(/|$)" % "|".join(SHARED))
    found = []
    for path in sorted((root / "pipeline").rglob("*.py")):
        if path.relative_to(root).as_posix() == "pipeline/store/paths.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            operands = []
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                operands = [node.left, node.right]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Path" and node.args:
                operands = node.args[:1]
            elif isinstance(node, ast.Constant) and id(node) not in docstrings and isinstance(node.value, str) \
                    and "/" in node.value:  # an f-string's leading part too
                operands = [node]
            for operand in operands:
                if isinstance(operand, ast.Constant) and isinstance(operand.value, str) and shared.match(operand.value):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {operand.value!r}")
    return found


def test_only_store_paths_names_files_under_the_shared_folders():
    assert path_literals(ROOT) == []


@pytest.mark.parametrize("text", ['OUT = Path("metrics")\n', 'OUT = folder / "caches" / "x"\n',
                                  'OUT = "models/best/mapped_k1.safetensors"\n', 'OUT = f"eval/{name}"\n'])
def test_the_path_literal_check_sees_a_literal_under_a_shared_folder(tmp_path, text):
    (tmp_path / "pipeline" / "store").mkdir(parents=True)
    (tmp_path / "pipeline" / "stage.py").write_text('"""models/ in a docstring is prose."""\n' + text)
    (tmp_path / "pipeline" / "store" / "paths.py").write_text('MODELS = Path("models")\n')
    assert [line.split(": ", 1)[0] for line in path_literals(tmp_path)] == ["pipeline/stage.py:2"]


MAX_FUNCTION_LINES, MAX_CLASS_LINES, MAX_MODULE_LINES = 60, 150, 400


def too_long(root: Path) -> list[str]:
    """Every function of pipeline/ over MAX_FUNCTION_LINES (decorators not counted), every class over
    MAX_CLASS_LINES (its methods' lines count: a class is split by idea like a module) and every module over
    MAX_MODULE_LINES, as `path:name (lines)`."""
    found = []
    for path in sorted((root / "pipeline").rglob("*.py")):
        name, text = str(path.relative_to(root)), path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            found.append(f"{name} ({len(text.splitlines())} lines)")
        for node in ast.walk(ast.parse(text)):
            limit = (MAX_FUNCTION_LINES if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     else MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else None)
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                found.append(f"{name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    return found


def test_every_function_fits_a_screen_and_every_class_and_module_holds_one_idea():
    assert too_long(ROOT) == []  # no exemption: a class over the limit is split by idea


def test_the_length_check_sees_a_long_function_a_long_class_and_a_long_module(tmp_path):
    (tmp_path / "pipeline").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    methods = "".join(f"    def m{i}(self):\n        pass\n" for i in range(MAX_CLASS_LINES // 2))
    (tmp_path / "pipeline" / "long.py").write_text(f"def f():\n{body}class C:\n{methods}" + "\n" * MAX_MODULE_LINES)
    lines = MAX_FUNCTION_LINES + 1 + MAX_CLASS_LINES + 1 + MAX_MODULE_LINES
    assert too_long(tmp_path) == [f"pipeline/long.py ({lines} lines)",
                                  f"pipeline/long.py:f ({MAX_FUNCTION_LINES + 1} lines)",
                                  f"pipeline/long.py:C ({MAX_CLASS_LINES + 1} lines)"]


MAX_MODULE_DOC_PROSE = 5  # a module docstring says what the module is for and why; indented lines (a diagram) aside


def long_module_docstrings(root: Path) -> list[str]:
    """Every module of pipeline/ whose docstring holds more than MAX_MODULE_DOC_PROSE prose lines (non-blank lines
    not indented by 4 spaces: a diagram where index arithmetic needs one is indented), as `path (lines)`."""
    found = []
    for path in sorted((root / "pipeline").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        prose = sum(1 for line in doc.splitlines() if line.strip() and not line.startswith("    "))
        if prose > MAX_MODULE_DOC_PROSE:
            found.append(f"{path.relative_to(root)} ({prose} lines)")
    return found


def test_every_module_docstring_says_what_the_module_is_for_in_five_lines():
    assert long_module_docstrings(ROOT) == []


def test_the_docstring_check_sees_a_long_module_docstring_but_not_an_indented_diagram(tmp_path):
    (tmp_path / "pipeline").mkdir()
    diagram = "".join(f"    slot {i} -> position {2 * i}\n" for i in range(8))
    (tmp_path / "pipeline" / "short.py").write_text(f'"""What it is for.\nWhy.\n\n{diagram}"""\nx = 1\n')
    (tmp_path / "pipeline" / "long.py").write_text('"""' + "A line.\n" * 6 + '"""\n')
    assert long_module_docstrings(tmp_path) == ["pipeline/long.py (6 lines)"]


def assigned_lambdas(root: Path) -> list[str]:
    """Every lint suppression of E731 (a lambda assigned to a name, which saves the lines of a def) under
    pipeline/ and tests/, as `path:line`."""
    found = []
    for folder in ("pipeline", "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"#\s*noqa:[^#]*\bE731\b", line):
                    found.append(f"{path.relative_to(root)}:{number}")
    return found


def test_no_lambda_is_assigned_to_a_name_to_save_lines():
    assert assigned_lambdas(ROOT) == []


def test_the_lambda_check_sees_a_suppressed_e731(tmp_path):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "pipeline" / "m.py").write_text("def f():\n    return 1\n")
    (tmp_path / "tests" / "t.py").write_text("x = 1\nf = lambda: 0  # noqa" + ": E731  (one line)\n")
    assert assigned_lambdas(tmp_path) == ["tests/t.py:2"]


def constants_defined_twice(root: Path) -> list[str]:
    """Module-level UPPER_CASE names of pipeline/ assigned in more than one module, and aliases of a store.paths
    constant (`X = paths.Y`) outside it, as `name: path, path`. A lazy module handle
    (`F = lazy("torch.nn.functional")`) is each module's own and passes."""
    places: dict[str, list[str]] = {}
    aliases = []
    for path in sorted((root / "pipeline").rglob("*.py")):
        where = str(path.relative_to(root))
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [name for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)]
            lazy = (isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name)
                    and node.value.func.id == "lazy")
            for name in names:
                if name.id.lstrip("_").isupper() and not lazy:
                    places.setdefault(name.id, []).append(where)
            paired = (zip(names, node.value.elts) if isinstance(node.value, ast.Tuple) and len(names) > 1
                      else zip(names, [node.value]))  # `A, B = paths.X, paths.Y` pairs each name with its value
            aliased = [name.id for name, value in paired if isinstance(value, ast.Attribute)
                       and isinstance(value.value, ast.Name) and value.value.id == "paths" and value.attr.isupper()]
            if aliased and where != "pipeline/store/paths.py":
                aliases.append(f"{', '.join(aliased)}: an alias of store.paths in {where}")
    return [f"{name}: {', '.join(where)}" for name, where in sorted(places.items()) if len(where) > 1] + aliases


def test_a_module_level_constant_is_defined_in_one_place_of_pipeline():
    assert constants_defined_twice(ROOT) == []


@pytest.mark.parametrize("second, found", [
    ('PARTS = ("a",)\n', ["PARTS: pipeline/a.py, pipeline/b.py"]),
    ('OUT, PARTS = paths.EVAL, 1\n',
     ["PARTS: pipeline/a.py, pipeline/b.py", "OUT: an alias of store.paths in pipeline/b.py"]),
    ('PAIR = (paths.EVAL, 1)\n', []),  # a tuple holding a path is not an alias of it
    ('F = lazy("torch.nn.functional")\n', []),
])
def test_the_constants_check_sees_a_name_defined_twice_and_an_alias_of_a_path(tmp_path, second, found):
    (tmp_path / "pipeline" / "store").mkdir(parents=True)
    (tmp_path / "pipeline" / "a.py").write_text('PARTS = ("b",)\nF = lazy("torch.nn.functional")\n')
    (tmp_path / "pipeline" / "b.py").write_text(second)
    (tmp_path / "pipeline" / "store" / "paths.py").write_text('EVAL = Path("eval")\nMODELS = EVAL\n')
    assert constants_defined_twice(tmp_path) == found
