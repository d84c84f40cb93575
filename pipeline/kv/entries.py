"""The one rule of kv's registries (mapper families, handoff modes, repair selectors): entries by name,
each a named instance of the registry's base class (so one that fills in its abstract cost and maths), no name twice."""
from __future__ import annotations


def register(base: type, plural: str, entries: tuple) -> dict:
    """`entries` by name; `plural` names them in the error for a name given twice."""
    kind = f"{base.__module__.removeprefix('pipeline.')}.{base.__qualname__}"
    for entry in entries:
        if not isinstance(entry, base) or not entry.name:
            raise TypeError(f"{entry!r} is not a named {kind} instance")
    names = [entry.name for entry in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"{plural} named twice: {names}")
    return {entry.name: entry for entry in entries}
