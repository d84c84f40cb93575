"""Parameter validation: typos, wrong types, out-of-range values and missing keys are errors naming the key;
values come only from params.yaml (parameter classes declare no defaults)."""
from typing import Annotated, Literal

import pytest
import yaml
from helpers import ROOT, committed
from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo

from pipeline.check_params import SECTIONS
from pipeline.store.params import Pair, ParamError, Params, Positive, Threads, load_value, parse

# mappings (variant -> file, family -> rate, map -> file), not sets of parameters
MAPPINGS = {"evaluate.mapped", "evaluate.repair", "distill.lrs", "repair.maps"}


class Inner(Params):
    rate: Annotated[float, Field(ge=0.0, le=1.0)]


class Section(Params):
    steps: Positive
    lambdas: list[Annotated[float, Field(ge=0.0)]]
    mode: Literal["a", "b"]
    path: str | None
    inner: Inner
    span: Pair
    names: Annotated[list[str], Field(min_length=1)]


VALID = {"steps": 3, "lambdas": [0, 2.5], "mode": "a", "path": None, "inner": {"rate": 1}, "span": [1, 2],
         "names": ["x"]}


def test_valid_section_parses():
    assert parse(Section, VALID, "s") == Section(steps=3, lambdas=[0.0, 2.5], mode="a", path=None,
                                                 inner=Inner(rate=1.0), span=(1, 2), names=["x"])


@pytest.mark.parametrize("change, message", [
    ({"stpes": 4}, r"s\.stpes: unknown parameter"),
    ({"steps": "3"}, r"s\.steps: expected an integer"),
    ({"steps": True}, r"s\.steps: expected an integer"),
    ({"steps": 0}, r"s\.steps: expected a number > 0"),
    ({"lambdas": [1, -1]}, r"s\.lambdas\[1\]: expected a number >= 0"),
    ({"lambdas": [float("nan")]}, r"s\.lambdas\[0\]: expected a finite number"),
    ({"mode": "c"}, r"s\.mode: expected one of 'a', 'b'"),
    ({"inner": {"rate": 2}}, r"s\.inner\.rate: expected a number <= 1"),
    ({"inner": {"rat": 0.5}}, r"s\.inner\.rat: unknown parameter"),
    ({"inner": {}}, r"s\.inner\.rate: missing parameter"),
    ({"inner": 3}, r"s\.inner: expected a mapping, got 3$"),
    ({"path": 3}, r"s\.path: expected a string, got 3$"),
    ({"lambdas": 0.5}, r"s\.lambdas: expected a list, got 0\.5$"),
    ({"span": [1]}, r"s\.span: expected a list of 2 values, got \[1\]$"),
    ({"span": [1, "2"]}, r"s\.span\[1\]: expected an integer, got '2'$"),
    ({"names": []}, r"s\.names: expected at least one value, got an empty list$"),
])
def test_bad_parameters_are_named(change, message):
    with pytest.raises(ParamError, match=message):
        parse(Section, {**VALID, **change}, "s")


@pytest.mark.parametrize("name", list(Section.model_fields))
def test_a_missing_key_is_an_error_even_where_null_is_allowed(name):
    with pytest.raises(ParamError, match=rf"s\.{name}: missing parameter"):
        parse(Section, {k: v for k, v in VALID.items() if k != name}, "s")


def test_a_unknown_key_is_named_before_the_missing_one_it_misspells():
    data = {k: v for k, v in VALID.items() if k != "steps"} | {"stpes": 3}
    with pytest.raises(ParamError, match=r"^s\.stpes: unknown parameter \(known: steps, lambdas, mode, path, inner, "):
        parse(Section, data, "s")


def test_every_section_and_part_of_one_is_a_strict_params_model():
    def walk(cls):
        yield cls
        for field in cls.model_fields.values():
            for option in getattr(field.annotation, "__args__", ()) + (field.annotation,):
                if isinstance(option, type) and issubclass(option, BaseModel):
                    yield from walk(option)
    assert all(issubclass(cls, Params) for section in SECTIONS.values() for cls in walk(section))


def test_parameter_classes_declare_no_default():
    def walk(cls):
        for name, field in cls.model_fields.items():
            yield cls, name, field
            for option in getattr(field.annotation, "__args__", ()) + (field.annotation,):
                if isinstance(option, type) and issubclass(option, BaseModel):
                    yield from walk(option)
    with_defaults = [f"{cls.__name__}.{name}" for section in SECTIONS.values() for cls, name, field in walk(section)
                     if not field.is_required()]
    assert with_defaults == []


def test_threads_and_the_device_are_declared_once_in_the_machine_section_and_no_stage_restates_them():
    def walk(cls):
        for name, field in cls.model_fields.items():
            yield name, field
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                yield from walk(field.annotation)
    found = {(section, name): field for section, cls in SECTIONS.items() for name, field in walk(cls)
             if name in ("threads", "device")}
    assert sorted(found) == [("machine", "device"), ("machine", "threads")], sorted(found)
    threads, declared = found[("machine", "threads")], FieldInfo.from_annotation(Threads)
    assert (threads.annotation, threads.metadata) == (declared.annotation, declared.metadata)
    for profile in sorted((ROOT / "conf" / "profile").glob("*.yaml")):  # no profile writes them under a stage
        written = yaml.safe_load(profile.read_text())
        restated = [name for name, section in written.items()
                    if name != "machine" and isinstance(section, dict) and {"threads", "device"} & set(section)]
        assert not restated, f"{profile.name}: threads or device under {restated}; set them in its machine section"


def leaves(data: dict, prefix: str = ""):
    for key, value in data.items():
        name = f"{prefix}{key}"
        yield name
        if isinstance(value, dict) and name not in MAPPINGS:
            yield from leaves(value, name + ".")


def drop(data: dict, dotted: str) -> dict:
    head, _, rest = dotted.partition(".")
    return {k: (drop(v, rest) if k == head and rest else v) for k, v in data.items() if not (k == head and not rest)}


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_committed_key_is_required(section):
    data = committed(section)
    parse(SECTIONS[section], data, section)
    for key in leaves(data, section + "."):
        with pytest.raises(ParamError, match=rf"^{key}: missing parameter"):
            parse(SECTIONS[section], drop(data, key.split(".", 1)[1]), section)


def test_a_value_no_section_class_holds_is_read_typed_and_refused_when_of_another_type(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"profile": "tiny"}))
    assert load_value(str, "profile") == "tiny"
    path.write_text(yaml.safe_dump({"profile": 3}))
    with pytest.raises(ParamError, match=r"^profile: expected a str, got 3$"):
        load_value(str, "profile")
