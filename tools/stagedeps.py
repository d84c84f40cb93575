"""`make deps`: each dvc.yaml stage's `pipeline/` deps rewritten from the import closure of the module it runs
(tools/importgraph.py: imports, `lazy(...)` references and stages run in a subprocess), as a recipe lists code: the
modules at the top of pipeline/ (the stage, the stages it runs, a shared module such as the lm-eval face) and the
stages' params classes under pipeline/schema/ as files, every other wing it reaches as its folder (`pipeline/kv`).
A change in a wing reruns every stage that imports anything from it: coarser than the modules, and honest. Each
stage reads: what runs (cmd), the params it reads, what it writes (outs, metrics, plots), then its deps, the data
first and the code last under one comment (`CODE`). Every other line stays as written (the file is edited as text,
stage by stage); a dep's trailing comment stays with it.

    python tools/stagedeps.py           # rewrite dvc.yaml in place
    python tools/stagedeps.py --check   # print the diff and exit 1 when dvc.yaml is stale

tests/project/test_dvc_yaml.py runs the check and fails with the diff.
"""
from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

import yaml
from importgraph import closure, graph, modules, stage_module

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "make deps"
STAGE = re.compile(r"^  (?P<name>[^\s#:][^:]*):")  # a key of `stages:` (two spaces in)
KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_]+):")
ITEM = re.compile(r"^(?P<indent> *)- (?P<value>[^\s#]+)(?P<comment> *#.*)?$")
FILED = ("schema",)  # wings whose modules are deps one by one: each is one stage's params class


def needed_modules(root: Path) -> dict[str, list[str]]:
    """Stage name -> the sorted files of every pipeline module its command imports, itself included."""
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    known, imports = modules(root), graph(root, subprocess=True)
    return {name: sorted(str(known[m].relative_to(root)) for m in closure(stage_module(stage), imports))
            for name, stage in stages.items()}


def code_dep(path: str) -> str:
    """The dep that covers a module's file: the file for a module at the top of pipeline/ or in a FILED wing,
    else its wing's folder (`pipeline/kv/modes.py` -> `pipeline/kv`)."""
    package, *rest = path.split("/")
    return path if len(rest) == 1 or rest[0] in FILED else f"{package}/{rest[0]}"


def needed_deps(root: Path) -> dict[str, list[str]]:
    """Stage name -> its code deps: its module and its schema, the other files, then the wing folders."""
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    deps = {}
    for name, paths in needed_modules(root).items():
        own = stage_module(stages[name]).removeprefix("pipeline.")
        found = {code_dep(path) for path in paths}
        first = [dep for dep in (f"pipeline/{own}.py", f"pipeline/schema/{own}.py") if dep in found]
        files = sorted(dep for dep in found - set(first) if dep.endswith(".py"))
        deps[name] = [*first, *files, *sorted(found - set(first) - set(files))]
    return deps


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


# where each key of a stage stands: what runs, what it reads of params, what it writes, then what it depends on
ORDER = {"foreach": 0, "do": 1, "cmd": 2, "params": 4, "outs": 5, "metrics": 6, "plots": 7, "deps": 8}  # others: 3
CODE = "# code (make deps): the modules the command runs and the wings they import"
CODE_KEY = "# code (make deps)"  # how the comment starts, whatever its wording was when written


def _blocks(body: list[str], indent: int) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """`body` cut into (key, lines) at `indent`: a key's line, what is indented under it, and the comment lines at
    `indent` just before it; then the trailing blank and comment lines that belong to no key."""
    blocks: list[tuple[str, list[str]]] = []
    pending: list[str] = []
    for line in body:
        match = KEY.match(line)
        if match and len(match["indent"]) == indent:
            blocks.append((match["key"], [*pending, line]))
            pending = []
        elif (not line.strip() or line.strip().startswith("#")) and _indent(line) <= indent:
            pending.append(line)
        else:
            blocks[-1][1].extend([*pending, line])
            pending = []
    return blocks, pending


def _deps(lines: list[str], needed: list[str], indent: int) -> list[str]:
    """A `deps:` block (its key line first, or none) as data deps, then the code comment and `needed`."""
    key = [line for line in lines if (m := KEY.match(line)) and len(m["indent"]) == indent]
    head = lines[: lines.index(key[0]) + 1] if key else [" " * indent + "deps:"]
    items = [(line, ITEM.match(line)) for line in lines[len(head):]]
    pad = next((m["indent"] for _, m in items if m), " " * (indent + 2))
    code = {m["value"]: m["comment"] or "" for _, m in items if m and m["value"].startswith("pipeline/")}
    data = [line for line, m in items
            if line.strip() and not line.strip().startswith(CODE_KEY) and not (m and m["value"] in code)]
    return [*head, *data, f"{pad}{CODE}", *(f"{pad}- {path}{code.get(path, '')}" for path in needed)]


def _ordered(body: list[str], needed: list[str]) -> list[str]:
    """A stage's lines under its name, its keys in ORDER (a `do:` block's own keys too) and its deps rewritten."""
    indent = next(_indent(line) for line in body if KEY.match(line))
    blocks, trailing = _blocks(body, indent)
    if "do" not in (key for key, _ in blocks) and "deps" not in (key for key, _ in blocks):
        blocks.append(("deps", []))
    out = []
    for key, lines in sorted(blocks, key=lambda block: ORDER.get(block[0], 3)):  # stable: others keep their order
        if key == "do":
            at = next(i for i, line in enumerate(lines) if KEY.match(line) and _indent(line) == indent)
            lines = [*lines[: at + 1], *_ordered(lines[at + 1:], needed)]
        elif key == "deps":
            lines = _deps(lines, needed, indent)
        out += lines
    return out + trailing


def rewritten(text: str, needed: dict[str, list[str]]) -> str:
    """dvc.yaml's text with each stage's keys in ORDER and its pipeline/ deps set to needed[stage] (needed_deps),
    last in its deps under the code comment; every other line stays as written."""
    lines = text.split("\n")
    top = next(i for i, line in enumerate(lines) if line.startswith("stages:"))
    after = next((i for i in range(top + 1, len(lines)) if lines[i] and not lines[i].startswith((" ", "#"))),
                 len(lines))
    starts = [i for i in range(top + 1, after) if STAGE.match(lines[i])]
    out = lines[:starts[0]]
    for start, end in zip(starts, [*starts[1:], after]):
        out += [lines[start], *_ordered(lines[start + 1:end], needed[STAGE.match(lines[start])["name"]])]
    return "\n".join(out + lines[after:])


def stale(root: Path) -> str:
    """The unified diff from dvc.yaml to what `make deps` writes; empty when it is current."""
    text = (root / "dvc.yaml").read_text()
    new = rewritten(text, needed_deps(root))
    lines = difflib.unified_diff(text.splitlines(True), new.splitlines(True), "dvc.yaml", f"dvc.yaml ({COMMAND})")
    return "".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="print the diff and exit 1 when dvc.yaml is stale")
    args = parser.parse_args(argv)
    diff = stale(ROOT)
    if args.check:
        print(diff + (f"dvc.yaml's stage deps are stale: run `{COMMAND}`" if diff else "dvc.yaml: stage deps current"))
        return 1 if diff else 0
    if diff:
        (ROOT / "dvc.yaml").write_text(rewritten((ROOT / "dvc.yaml").read_text(), needed_deps(ROOT)))
    print(f"dvc.yaml: {'stage deps rewritten' if diff else 'stage deps already current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
