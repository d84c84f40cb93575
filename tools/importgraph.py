"""The import graph of a package tree, read from source (nothing is imported): modules by dotted name, their
`pipeline.*` imports (an `import` statement, or a `lazy("pipeline.X")` reference of store.lazy: an import
deferred to first use), and the other stages they run in a subprocess (a `python -m pipeline.X` list, or
`run_stage("pipeline.X", ...)` of store.cli), which the dvc.yaml deps count as imports; and the module each
dvc.yaml stage runs."""
from __future__ import annotations

import ast
from pathlib import Path

STAGE_RUNNER = "run_stage"  # store.cli's function that runs another stage's command: its first argument names it
LAZY = "lazy"  # store.lazy's deferred import: its first argument names the module


def body(stage: dict) -> dict:
    """A dvc.yaml stage's definition (the `do` of a foreach stage)."""
    return stage.get("do", stage)


def stage_module(stage: dict) -> str:
    """The module a dvc.yaml stage runs: the X of its `python -m pipeline.X`."""
    return "pipeline." + body(stage)["cmd"].split("-m pipeline.")[1].split()[0]


def modules(root: Path, package: str = "pipeline") -> dict[str, Path]:
    """Dotted name -> file for every module under root/package (package __init__ files left out)."""
    base = root / package
    return {".".join(path.relative_to(root).with_suffix("").parts): path
            for path in sorted(base.rglob("*.py")) if path.name != "__init__.py"}


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    return name if name in known else None


def edges(path: Path, known: dict[str, Path], package: str = "pipeline") -> dict[str, list[tuple[str, int, bool]]]:
    """Imports of one file: {"import": [(module, line, inside_function)], "subprocess": [(module, line, False)],
    "unnamed": [(name or "?", line, False)] for each stage runner or lazy reference whose module the deps
    cannot read: not a literal, or a `pipeline.*` name that is no module}."""
    tree = ast.parse(path.read_text())
    found: dict[str, list[tuple[str, int, bool]]] = {"import": [], "subprocess": [], "unnamed": []}
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    nested = {id(inner) for fn in functions for inner in ast.walk(fn) if inner is not fn}
    for node in ast.walk(tree):
        inside = id(node) in nested
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                     for alias in node.names]
        elif isinstance(node, (ast.List, ast.Tuple)):
            items = [e.value if isinstance(e, ast.Constant) and isinstance(e.value, str) else None for e in node.elts]
            for flag, target in zip(items, items[1:]):
                if flag == "-m" and target and target.split(".")[0] == package:
                    found["subprocess"].append((target, node.lineno, False))
            continue
        elif isinstance(node, ast.Call) and _called(node) == STAGE_RUNNER:
            first = node.args[0] if node.args else None
            target = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
            if target and target.split(".")[0] == package:
                found["subprocess"].append((target, node.lineno, False))
            elif not target:  # a stage named by a variable: the deps could not see it
                found["unnamed"].append(("?", node.lineno, False))
            continue
        elif isinstance(node, ast.Call) and _called(node) == LAZY:
            first = node.args[0] if node.args else None
            target = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
            if not target or (target.split(".")[0] == package and not _resolve(target, known)):
                found["unnamed"].append((target or "?", node.lineno, False))
            names = [target] if target else []
        for name in names:
            if name.split(".")[0] == package and _resolve(name, known):
                found["import"].append((name, node.lineno, inside))
    return found


def _called(call: ast.Call) -> str | None:
    """The name a call calls: `f` of `f(...)` and of `module.f(...)`."""
    return call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)


def graph(root: Path, package: str = "pipeline", subprocess: bool = False) -> dict[str, set[str]]:
    known = modules(root, package)
    out = {}
    for name, path in known.items():
        found = edges(path, known, package)
        out[name] = ({m for m, _, _ in found["import"]}
                     | ({m for m, _, _ in found["subprocess"]} if subprocess else set()))
    return out


def closure(start: str, graph_: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo += graph_[current]
    return seen


def cycle(graph_: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph_[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph_):
        if node not in state and (found := visit(node)):
            return found
    return None
