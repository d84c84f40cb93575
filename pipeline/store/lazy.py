"""A module imported on first use: `torch = lazy("torch")` at the top of a module, then `torch.cat(...)` as usual,
so a stage's `--help` or refusal does not cost the seconds torch, transformers or pandas take to import. Anything
evaluated at import (a decorator, a default argument, a base class, a pydantic field's type) loads it at once.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule:
    """Stands for module `name`, importing it at the first attribute read; it never copies attributes, so one
    replaced later (a test's monkeypatch) is seen, and setting one sets the module's. Not importlib.util.LazyLoader,
    which puts a half-made module into sys.modules: torch's import walks sys.modules (through `inspect`), making
    transformers' lazy module load itself inside its own load ("module object for 'transformers' substituted in
    sys.modules during a lazy load"). This proxy never enters sys.modules."""

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_module", None)

    def _load(self) -> ModuleType:
        if self._module is None:
            object.__setattr__(self, "_module", importlib.import_module(self._name))
        return self._module

    def __getattr__(self, attribute: str) -> Any:  # only called for what the proxy itself lacks
        return getattr(self._load(), attribute)

    def __setattr__(self, attribute: str, value: Any) -> None:
        setattr(self._load(), attribute, value)

    def __dir__(self) -> list[str]:
        return dir(self._load())

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{'' if self._module is None else ' (imported)'}>"


def lazy(name: str) -> Any:
    """A stand-in for `import name`; `name` is a literal: tools/importgraph.py reads `lazy("pipeline.x.y")` as an
    import of that module."""
    return LazyModule(name)
