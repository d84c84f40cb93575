"""The gate's scores as a registry (`kv.scores`): a score is its module and its registry line, and nothing else is
edited to compute it, gate on it or count its cost."""
import pytest
import torch
from helpers import build_model, tiny_config

from pipeline.kv.gate import Gate, Scorer
from pipeline.kv.handoff import Handoff
from pipeline.kv.mapper import random_mapper
from pipeline.kv.scores.base import Evidence, Score, Work
from pipeline.kv.scores.registry import SCORES, register, score_macs

VOCAB = 97


class Length(Score):
    """A fake score: each context's prefix length, read off the first step (longer: less trusted)."""

    name = "length"

    def reads(self, scorer) -> tuple[str, ...]:
        return ("entropy",)  # computed first, so a score may read another's values

    def score(self, evidence: Evidence) -> torch.Tensor:
        assert "entropy" in evidence.values
        return evidence.first.prefixes.lengths.double()  # (B,)

    def cost(self, work: Work) -> int:
        return work.length - 1


@pytest.fixture(scope="module")
def handoff():
    target, source = build_model(tiny_config(VOCAB, 64), seed=1), build_model(tiny_config(VOCAB, 32), seed=2)
    return Handoff(target, source, "mapped", random_mapper(source.config, target.config, seed=1))


def test_a_score_registered_in_a_temporary_registry_reaches_the_gate_with_no_other_file_edited(handoff):
    registry = register(*SCORES.values(), Length())
    contexts = [[5, 6], [1, 2, 3, 4, 5, 6], [7], [8, 9, 10, 11]]
    scorer = Scorer(handoff, scores=registry)
    assert scorer.scores(contexts, ["length"])["length"].tolist() == [1.0, 5.0, float("-inf"), 3.0]
    gate = Gate(scorer, "length", 2.0, Handoff(handoff.decoder))
    _, fell_back = gate.route(contexts)
    assert fell_back.tolist() == [False, True, False, True]
    assert score_macs("length", handoff.source.config, handoff.decoder.config, 0, 10, scores=registry) == 9


def test_a_score_outside_the_registry_is_refused_naming_the_known_ones(handoff):
    with pytest.raises(ValueError, match=r"unknown score 'length' \(known: entropy, kl, disagree, probe\)"):
        Gate(Scorer(handoff), "length", 0.0, Handoff(handoff.decoder))
    with pytest.raises(ValueError, match="unknown score 'length'"):
        score_macs("length", handoff.source.config, handoff.decoder.config, 0, 10)


def test_a_score_whose_needs_are_missing_is_refused_in_one_line(handoff):
    with pytest.raises(ValueError, match=r"^the 'disagree' score needs its two maps \(k=1 and k=max\)$"):
        Scorer(handoff).check(["disagree"])
    with pytest.raises(ValueError, match=r"^the 'probe' score needs a probe fitted on dev items"):
        Scorer(handoff).check(["probe"])


def test_the_registry_refuses_an_unnamed_entry_or_a_name_twice():
    with pytest.raises(TypeError, match="is not a named kv.scores.base.Score instance"):
        register(object())
    with pytest.raises(ValueError, match="scores named twice"):
        register(*SCORES.values(), SCORES["entropy"])
