"""The gate's scores as a registry (`kv.scores`): a score is one class (its name, needs, cost and maths) and a
registry line, and nothing else is edited to compute it, gate on it, count its cost or read it in the selective
stage's summary and the report; a score without a cost or maths cannot be made."""
import numpy as np
import pandas as pd
import pytest
import torch
from helpers import build_model, committed, measure_params, tiny_config

import pipeline.schema.selective as selective_schema
import pipeline.selective as selective_stage
from pipeline.kv.gate import Gate, Scorer
from pipeline.kv.handoff import Handoff
from pipeline.kv.mapper import random_mapper
from pipeline.kv.scores import SCORES, Evidence, Score, Work, register, score_macs
from pipeline.measure.confident import MARGINS
from pipeline.schema.selective import SelectiveParams
from pipeline.store.params import parse
from pipeline.studies import render
from pipeline.studies import selective as study
from pipeline.studies.settings import ReportParams

VOCAB = 97


class Length(Score):
    """A fake score: each context's prefix length, read off the first step (longer: less trusted)."""

    name = "length"

    def reads(self, scorer) -> tuple[str, ...]:
        return ("entropy",)  # computed first, so a score may read another's values

    def cost(self, work: Work) -> int:
        return work.length - 1

    def score(self, evidence: Evidence) -> torch.Tensor:
        assert "entropy" in evidence.values
        return evidence.first.prefixes.lengths.double()  # (B,)


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
    with pytest.raises(TypeError, match="is not a named kv.scores.Score instance"):
        register(object())
    with pytest.raises(ValueError, match="scores named twice"):
        register(*SCORES.values(), SCORES["entropy"])


def test_a_score_without_maths_or_without_a_cost_cannot_be_made_or_registered():
    class Scoreless(Score):
        name = "scoreless"

        def cost(self, work: Work) -> int:
            return 0

    class Costless(Score):
        name = "costless"

        def score(self, evidence: Evidence) -> torch.Tensor:
            return evidence.logprobs[:, 0]

    with pytest.raises(TypeError, match="score"):
        Scoreless()
    with pytest.raises(TypeError, match="cost"):
        Costless()
    with pytest.raises(TypeError, match="is not a named kv.scores.Score instance"):
        register(Scoreless)


def test_a_score_in_a_temporary_registry_reaches_the_stages_summary_and_the_reports_lines_by_its_own_name(
        handoff, monkeypatch):
    registry = register(*SCORES.values(), Length())
    for module in (selective_schema, selective_stage):  # where the stage and its params read the registry
        monkeypatch.setattr(module, "SCORES", registry)
    generator = torch.Generator().manual_seed(0)
    contexts = [torch.randint(0, VOCAB, (int(n),), generator=generator).tolist()
                for n in torch.randint(2, 30, (40,), generator=generator)]
    values = Scorer(handoff, scores=registry).scores(contexts, ["length"])["length"].numpy()  # (40,)
    changed = values > np.median(values)  # what the map changes: the long contexts, which the score ranks first
    column = selective_stage.column("length")
    items = pd.concat([pd.DataFrame({"part": part, "map": "a", "task": np.where(np.arange(40) % 2, "piqa", "hellaswag"),
                                     "item": range(40), "mapped": (~changed).astype(int), "oracle": 1, "source": 0,
                                     "changed": changed, column: values}) for part in ("dev", "eval")],
                      ignore_index=True)
    prompts = pd.DataFrame({"map": "a", "prompt": range(40), "first_agree": (~changed).astype(int),
                            "rollout_agree": (~changed).astype(int), "horizon": 1, MARGINS: [[0.9, 0.0]] * 40,
                            "changed": changed, column: values})
    params = parse(SelectiveParams, {**committed("selective"), "maps": {"a": "models/mapper.safetensors"},
                                     "scores": ["length"]}, "selective")
    costs = {"a": {"target_ms": 10.0, "handoff_ms": 4.0, "length_ms": 0.1, "target": 10.0, "handoff": 3.0,
                   "length": 0.01}}
    metrics, curves = selective_stage.summarize(items, prompts, params, costs, measure_params(bootstrap_iters=100))
    assert metrics["maps"]["a"]["scores"]["length"]["auroc_items"] == 1.0
    report = parse(ReportParams, committed("report"), "report")
    text = render.section("selective", study.compute(report, measure_params(), study.Inputs(metrics, curves)))
    assert "AUROC on the eval items length 1.000" in text
