"""The one rule of kv's registries (modes, gate scores, repair selectors, mapper families): entries by name, each a
named instance of the registry's base class, no name twice; and, where an entry's maths (its torch code) lives apart
from its declaration (`kv/<registry>/maths/`, so what only names entries imports none of it), one maths for each
declared entry, keyed by its name."""
from __future__ import annotations

from typing import Mapping


def register(base: type, plural: str, entries: tuple) -> dict:
    """`entries` by name; anything but a named `base` instance is refused, and so is a name given twice (`plural`
    names the entries in that message)."""
    kind = f"{base.__module__.removeprefix('pipeline.')}.{base.__qualname__}"
    for entry in entries:
        if not isinstance(entry, base) or not entry.name:
            raise TypeError(f"{entry!r} is not a named {kind} instance")
    names = [entry.name for entry in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"{plural} named twice: {names}")
    return {entry.name: entry for entry in entries}


class Maths:
    """What an entry's maths shares: the declaration it computes (an entry of the declarations' registry), whose
    name it goes by."""

    declaration = None

    @property
    def name(self) -> str:
        return "" if self.declaration is None else self.declaration.name


def register_maths(base: type, plural: str, maths: tuple, declared: Mapping) -> dict:
    """`maths` by name as `register` takes them, one for each entry of `declared` and for nothing else: a declared
    entry without maths, or maths whose declaration is not the declared entry of its name, is refused in one line
    naming the registry to add it to."""
    found = register(base, plural, maths)
    package = base.__module__.removeprefix("pipeline.").removesuffix(".base")  # kv.modes.maths
    for name in declared:
        if name not in found:
            raise ValueError(f"{name!r} is declared ({package.removesuffix('.maths')}.registry) but has no maths: add "
                             f"them in {package.replace('.', '/')}/ and their line in {package}.registry")
    for name, entry in found.items():
        if declared.get(name) is not entry.declaration:
            raise ValueError(f"the maths {name!r} compute no declared entry ({', '.join(declared)}): declare it in "
                             f"{package.removesuffix('.maths')}.registry first")
    return found
