"""Typed, validated parameters: each stage parses the sections of params.yaml it reads into dataclasses.

Validation happens when a stage starts: unknown keys, missing keys, wrong types and out-of-range values are
errors naming the key (`fit.lambdas[2]: expected a number >= 0, got -1`). Values live only in params.yaml
(composed from conf/): a parameter dataclass declares types, ranges and choices (`spec(...)`), never a
default, so every field must be present; `null` is a value where the type allows it.
"""
from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, TypeVar, get_args, get_origin, get_type_hints

import yaml

from pipeline.store.cli import Refusal

T = TypeVar("T")
PARAMS_FILE = Path("params.yaml")


class ParamError(Refusal, ValueError):
    pass


def spec(*, min: float | None = None, max: float | None = None, positive: bool = False,
         nonempty: bool = False) -> Any:
    """A required dataclass field with a declared range; `positive` means > 0, `nonempty` a list of at least
    one value."""
    return dataclasses.field(metadata={"min": min, "max": max, "positive": positive, "nonempty": nonempty})


def read_params(path: str | Path = PARAMS_FILE) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ParamError(f"{path} not found: run from the repository root")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ParamError(f"{path}: expected a mapping at the top level")
    return data


def read_key(name: str, path: str | Path = PARAMS_FILE) -> Any:
    """The raw value at `name` (dots for nesting) of params.yaml."""
    data: Any = read_params(path)
    for part in name.split("."):
        if not isinstance(data, dict) or part not in data:
            raise ParamError(f"{path}: missing {name!r}")
        data = data[part]
    return data


def load_section(cls: type[T], name: str, path: str | Path = PARAMS_FILE) -> T:
    """Parse section `name` (dots for nesting) of params.yaml into `cls`."""
    return parse(cls, read_key(name, path), name)


def parse(cls: type[T], data: Any, where: str) -> T:
    if not isinstance(data, Mapping):
        raise ParamError(f"{where}: expected a mapping, got {data!r}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ParamError(f"{where}.{unknown[0]}: unknown parameter (known: {', '.join(fields)})")
    values = {}
    for name, field in fields.items():
        key = f"{where}.{name}"
        if name not in data:
            raise ParamError(f"{key}: missing parameter (every parameter is set in params.yaml / conf/)")
        values[name] = _check_range(_convert(hints[name], data[name], key), field.metadata, key)
    return cls(**values)


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors = []
        for option in options:
            try:
                return _convert(option, value, key)
            except ParamError as err:
                errors.append(str(err))
        raise ParamError(errors[0])
    if origin is Literal:
        if value not in args:
            raise ParamError(f"{key}: expected one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ParamError(f"{key}: expected a list, got {value!r}")
        return [_convert(args[0], item, f"{key}[{i}]") for i, item in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ParamError(f"{key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_convert(hint_i, item, f"{key}[{i}]") for i, (hint_i, item) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ParamError(f"{key}: expected a mapping, got {value!r}")
        return {str(k): _convert(args[1], v, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return parse(hint, value, key)
    if hint is bool:
        if not isinstance(value, bool):
            raise ParamError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ParamError(f"{key}: expected a finite number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ParamError(f"{key}: expected a string, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported parameter type {hint!r}")


def _check_range(value: Any, metadata: Mapping, key: str) -> Any:
    if metadata.get("nonempty") and isinstance(value, (list, tuple)) and not value:
        raise ParamError(f"{key}: expected at least one value, got an empty list")
    items = value if isinstance(value, (list, tuple)) else [value]
    for i, item in enumerate(items):
        if not isinstance(item, (int, float)) or isinstance(item, bool):
            continue
        name = f"{key}[{i}]" if isinstance(value, (list, tuple)) else key
        low, high = metadata.get("min"), metadata.get("max")
        if metadata.get("positive") and not item > 0:
            raise ParamError(f"{name}: expected a number > 0, got {item!r}")
        if low is not None and item < low:
            raise ParamError(f"{name}: expected a number >= {low}, got {item!r}")
        if high is not None and item > high:
            raise ParamError(f"{name}: expected a number <= {high}, got {item!r}")
    return value
