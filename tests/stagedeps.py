"""`make deps`: each dvc.yaml stage's `pipeline/` deps rewritten from the import closure of the module it runs
(tests/importgraph.py: imports, `lazy(...)` references and stages run in a subprocess), so a code change reruns
exactly the stages it can affect. Only those lines change: the other deps, comments, order and every other key
stay as written (the file is edited as text, stage by stage). A module's trailing comment stays with it.

    python tests/stagedeps.py           # rewrite dvc.yaml in place
    python tests/stagedeps.py --check   # print the diff and exit 1 when dvc.yaml is stale

tests/test_dvc_yaml.py runs the check and fails with the diff.
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


def needed_modules(root: Path) -> dict[str, list[str]]:
    """Stage name -> the sorted files of every pipeline module its command imports, itself included."""
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    known, imports = modules(root), graph(root, subprocess=True)
    return {name: sorted(str(known[m].relative_to(root)) for m in closure(stage_module(stage), imports))
            for name, stage in stages.items()}


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _rewrite_deps(lines: list[str], start: int, end: int, needed: list[str]) -> list[str]:
    """lines[start:end] (one stage) with its `deps:` list's pipeline/ items replaced by `needed`, where the first of
    them stood (or at the top of the list); a stage without `deps:` gets one after its `cmd:`."""
    deps = next((i for i in range(start, end) if (m := KEY.match(lines[i])) and m["key"] == "deps"), None)
    if deps is None:
        cmd = next(i for i in range(start, end) if (m := KEY.match(lines[i])) and m["key"] == "cmd")
        pad = " " * _indent(lines[cmd])
        return [*lines[start:cmd + 1], f"{pad}deps:", *(f"{pad}  - {p}" for p in needed), *lines[cmd + 1:end]]
    block_end = deps + 1
    while block_end < end and (not lines[block_end].strip() or _indent(lines[block_end]) > _indent(lines[deps])):
        block_end += 1
    block = lines[deps + 1:block_end]
    items = [ITEM.match(line) for line in block]
    pad = next((m["indent"] for m in items if m), " " * (_indent(lines[deps]) + 2))
    comments = {m["value"]: m["comment"] or "" for m in items if m and m["value"].startswith("pipeline/")}
    listed = [f"{pad}- {path}{comments.get(path, '')}" for path in needed]
    body, placed = [], False
    for line, m in zip(block, items):
        if m and m["value"] in comments:  # the regenerated list stands where the first pipeline/ item stood
            body += [] if placed else listed
            placed = True
        else:
            body.append(line)
    body = body if placed else [*listed, *body]
    return [*lines[start:deps + 1], *body, *lines[block_end:end]]


def rewritten(text: str, needed: dict[str, list[str]]) -> str:
    """dvc.yaml's text with each stage's pipeline/ deps set to needed[stage]; nothing else changes."""
    lines = text.split("\n")
    top = next(i for i, line in enumerate(lines) if line.startswith("stages:"))
    after = next((i for i in range(top + 1, len(lines)) if lines[i] and not lines[i].startswith((" ", "#"))),
                 len(lines))
    starts = [i for i in range(top + 1, after) if STAGE.match(lines[i])]
    out = lines[:top + 1]
    for start, end in zip(starts, [*starts[1:], after]):
        out += _rewrite_deps(lines, start, end, needed[STAGE.match(lines[start])["name"]])
    return "\n".join(out + lines[after:])


def stale(root: Path) -> str:
    """The unified diff from dvc.yaml to what `make deps` writes; empty when it is current."""
    text = (root / "dvc.yaml").read_text()
    new = rewritten(text, needed_modules(root))
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
        (ROOT / "dvc.yaml").write_text(rewritten((ROOT / "dvc.yaml").read_text(), needed_modules(ROOT)))
    print(f"dvc.yaml: {'stage deps rewritten' if diff else 'stage deps already current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
