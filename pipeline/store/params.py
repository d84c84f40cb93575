"""Typed, validated parameters: each stage parses the sections of params.yaml it reads into strict pydantic models
(`pipeline.schema.<stage>`: types, ranges and choices, never a default; no "3" for 3, no true for 1, no NaN), with the
rules between keys (`model_validator`) beside their fields, so `pipeline.check_params` sees every rule a stage would.
"""
from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, TypeVar, get_args, get_origin

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from pipeline.store.cli import Refusal

T = TypeVar("T", bound=BaseModel)
V = TypeVar("V")
PARAMS_FILE = Path("params.yaml")
MISSING = "missing parameter (every parameter is set in params.yaml / conf/)"


class ParamError(Refusal, ValueError):
    """A parameter the user sets is wrong: one line naming the key, exit 2."""


class Params(BaseModel):

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _pair(value: Any) -> Any:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return tuple(value)  # YAML has no tuples; strict validation then checks both items
    raise ValueError(f"expected a list of 2 values, got {value!r}")


# the shared shapes of parameters: one declaration for what several stages read the same way
Threads = Annotated[int, Field(ge=1)]  # torch CPU threads of a stage process
Processes = Annotated[int, Field(ge=1)]  # torchrun processes of a stage (store.ranks)
Positive = Annotated[int, Field(gt=0)]
Count = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
Share = Annotated[float, Field(ge=0, le=1)]
Pair = Annotated[tuple[int, int], BeforeValidator(_pair)]  # an inclusive range (low, high) written [low, high]
Dtype = Literal["float32", "bfloat16", "float16"]


def read_params() -> dict:
    if not PARAMS_FILE.is_file():
        raise ParamError(f"{PARAMS_FILE} not found: run from the repository root")
    data = yaml.safe_load(PARAMS_FILE.read_text()) or {}
    if not isinstance(data, dict):
        raise ParamError(f"{PARAMS_FILE}: expected a mapping at the top level")
    return data


def read_key(name: str) -> Any:
    data: Any = read_params()
    for part in name.split("."):
        if not isinstance(data, dict) or part not in data:
            raise ParamError(f"{PARAMS_FILE}: missing {name!r}")
        data = data[part]
    return data


def load_value(kind: type[V], name: str) -> V:
    """A value no section class holds (the top-level `profile`), refused unless it is a `kind`."""
    value = read_key(name)
    if not isinstance(value, kind):
        raise ParamError(f"{name}: expected a {kind.__name__}, got {value!r}")
    return value


def load_section(cls: type[T], name: str) -> T:
    return parse(cls, read_key(name), name)


def parse(cls: type[T], data: Any, where: str) -> T:
    """`data` validated as `cls` (`where`: its dotted key). pydantic's first error (an unknown key first: a misspelt
    key also leaves its real name missing) becomes one `ParamError` line naming the key (`fit.mlp.ks[0]`)."""
    if not isinstance(data, Mapping):
        raise ParamError(f"{where}: expected a mapping, got {data!r}")
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        errors = err.errors()
        first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
        raise ParamError(_line(cls, first, where)) from None


def _line(cls: type[BaseModel], error: Mapping, where: str) -> str:
    loc, kind, ctx, value = error["loc"], error["type"], error.get("ctx") or {}, error["input"]
    key = where + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)
    key = key.lstrip(".")
    if kind == "value_error" and isinstance(ctx.get("error"), ParamError):
        return str(ctx["error"])
    if kind == "missing":
        return f"{key}: {MISSING}"
    if kind == "extra_forbidden":
        return f"{key}: unknown parameter (known: {', '.join(_fields_at(cls, loc[:-1]))})"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        bound = next(iter(ctx.values()))  # a float field's bound comes back a float: `>= 0`, not `>= 0.0`
        bound = int(bound) if isinstance(bound, float) and bound.is_integer() else bound
        return f"{key}: expected a number {bounds[kind]} {bound}, got {value!r}"
    if kind == "literal_error":
        return f"{key}: expected one of {', '.join(ctx['expected'].rsplit(' or ', 1))}, got {value!r}"
    if kind == "value_error":
        return f"{key}: {ctx['error']}"
    if kind == "too_short":
        return f"{key}: expected at least one value, got an empty list"
    expected = {"int_type": "an integer", "float_type": "a finite number", "finite_number": "a finite number",
                "bool_type": "true or false", "string_type": "a string", "list_type": "a list",
                "dict_type": "a mapping", "model_type": "a mapping"}
    return f"{key}: expected {expected.get(kind, error['msg'])}, got {value!r}"


def _fields_at(cls: type[BaseModel], loc: tuple) -> list[str]:
    hint: Any = cls
    for part in loc:
        hint = _unwrap(hint)
        if isinstance(part, str) and isinstance(hint, type) and issubclass(hint, BaseModel):
            hint = hint.model_fields[part].annotation
        else:  # a list index or a mapping's key: the item type
            hint = get_args(hint)[-1]
    return list(_unwrap(hint).model_fields)


def _unwrap(hint: Any) -> Any:
    while True:
        if get_origin(hint) is Annotated:
            hint = get_args(hint)[0]
        elif get_origin(hint) in (typing.Union, types.UnionType):
            hint = next(arg for arg in get_args(hint) if arg is not type(None))
        else:
            return hint
