"""dvc.yaml lists, for every stage, the stage's module and every pipeline module it imports (transitively),
so a code change reruns exactly the stages it can affect."""
import ast
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def imports(module: str) -> set[str]:
    tree = ast.parse((ROOT / "pipeline" / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeline."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.ImportFrom) and node.module == "pipeline":
            found |= {alias.name for alias in node.names}
    return found


def closure(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo += imports(current)
    return seen


def stage_modules(stage: dict) -> tuple[str, set[str]]:
    body = stage.get("do", stage)
    module = body["cmd"].split("-m pipeline.")[1].split()[0]
    listed = {Path(d).stem for d in body["deps"] if isinstance(d, str) and d.startswith("pipeline/")}
    return module, listed


def test_every_stage_depends_on_the_modules_it_imports():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        module, listed = stage_modules(stage)
        missing = closure(module) - listed
        assert not missing, f"stage {name}: deps lack pipeline/{', pipeline/'.join(sorted(missing))}"
        extra = listed - closure(module)
        assert not extra, f"stage {name}: deps list modules it does not import: {sorted(extra)}"
