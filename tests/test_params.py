"""Parameter validation: typos, wrong types and out-of-range values are errors naming the key."""
from dataclasses import dataclass, field
from typing import Literal

import pytest

from pipeline.params import ParamError, parse, spec


@dataclass
class Inner:
    rate: float = spec(0.1, min=0.0, max=1.0)


@dataclass
class Section:
    steps: int = spec(positive=True)
    lambdas: list[float] = spec([1.0], min=0.0)
    mode: Literal["a", "b"] = "a"
    path: str | None = None
    inner: Inner = field(default_factory=Inner)


def test_valid_section_parses_with_defaults():
    parsed = parse(Section, {"steps": 3, "lambdas": [0, 2.5], "inner": {"rate": 1}}, "s")
    assert parsed == Section(steps=3, lambdas=[0.0, 2.5], inner=Inner(rate=1.0))


@pytest.mark.parametrize("data, message", [
    ({"steps": 3, "stpes": 4}, r"s\.stpes: unknown parameter"),
    ({}, r"s\.steps: missing parameter"),
    ({"steps": "3"}, r"s\.steps: expected an integer"),
    ({"steps": True}, r"s\.steps: expected an integer"),
    ({"steps": 0}, r"s\.steps: expected a number > 0"),
    ({"steps": 1, "lambdas": [1, -1]}, r"s\.lambdas\[1\]: expected a number >= 0"),
    ({"steps": 1, "lambdas": [float("nan")]}, r"s\.lambdas\[0\]: expected a finite number"),
    ({"steps": 1, "mode": "c"}, r"s\.mode: expected one of 'a', 'b'"),
    ({"steps": 1, "inner": {"rate": 2}}, r"s\.inner\.rate: expected a number <= 1"),
    ({"steps": 1, "inner": {"rat": 0.5}}, r"s\.inner\.rat: unknown parameter"),
])
def test_bad_parameters_are_named(data, message):
    with pytest.raises(ParamError, match=message):
        parse(Section, data, "s")
