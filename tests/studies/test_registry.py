"""The report's studies keep one declared protocol (studies.run.Study), are listed once (studies.registry), and the
report computes, joins and writes each by looping over that list: a study that breaks the protocol is refused."""
from types import ModuleType

import pytest

from pipeline import report
from pipeline.studies import repair, variants
from pipeline.studies.registry import STUDIES, checked
from pipeline.studies.run import Joining, Study


def fake_study(name: str, **extra) -> ModuleType:
    """A module with the protocol's four functions (its result: its name and who joined it), and `extra`."""
    module = ModuleType(name)
    module.load = lambda run: {"name": name}
    module.compute = lambda params, measure, inputs: {"name": inputs["name"], "joined": []}
    module.shown = lambda study: {}
    module.figure = lambda study, folder: {}
    for key, value in extra.items():
        setattr(module, key, value)
    return module


def test_every_registered_study_keeps_the_protocol_and_the_repair_study_joins_the_candidates():
    assert all(isinstance(module, Study) for module in STUDIES.values())
    assert [key for key, module in STUDIES.items() if isinstance(module, Joining)] == ["repair"]
    assert repair.JOINS == "candidates" and "candidates" in STUDIES


def test_a_study_without_a_function_of_the_protocol_is_refused_naming_it():
    broken = fake_study("pipeline.studies.broken")
    del broken.figure
    with pytest.raises(TypeError, match=r"study 'broken' \(pipeline.studies.broken\) lacks figure of the Study"):
        checked({"broken": broken})


@pytest.mark.parametrize("extra, message", [
    ({"JOINS": "nowhere", "join": lambda study, other: None}, "joins 'nowhere', which is not a study of STUDIES"),
    ({"join": lambda study, other: None}, "defines one of `join` and `JOINS`"),
    ({"JOINS": "plain"}, "defines one of `join` and `JOINS`"),
])
def test_a_join_with_a_study_not_listed_or_half_declared_is_refused(extra, message):
    with pytest.raises(TypeError, match=message):
        checked({"plain": fake_study("plain"), "joining": fake_study("joining", **extra)})


def test_the_report_joins_a_study_with_the_one_it_names_once_every_study_is_computed(monkeypatch):
    def join(study: dict, other: dict | None) -> None:
        study["joined"].append(None if other is None else other["name"])

    # the joining study comes first: its join must still see the other's computed result
    studies = checked({"joining": fake_study("joining", JOINS="other", join=join), "other": fake_study("other")})
    monkeypatch.setattr(report, "STUDIES", studies)
    monkeypatch.setattr(variants, "compute", lambda params, measure, run: {"selected": "x"})
    inputs = {key: study.load(None) for key, study in studies.items()}
    assert report.compute(None, None, None, inputs)["joining"]["joined"] == ["other"]
    assert report.compute(None, None, None, {"joining": inputs["joining"]})["joining"]["joined"] == [None]
    assert "joining" not in report.compute(None, None, None, {"other": inputs["other"]})  # nothing to join
