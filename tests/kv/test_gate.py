"""The gate (`kv.gate`): scores from the handoff's first step only (the target never prefills the prompt), a
padded batch scored as each context alone, the gate's limits at plus and minus infinity, a fallback that is the
target's own prefill, and the probe's fit; on the Qwen3-shaped and the Llama tiny pair."""
import math

import numpy as np
import pytest
import torch
from helpers import ARCHITECTURES, build_model

from pipeline.kv.gate import Gate, Probe, Scorer, fit_probe
from pipeline.kv.handoff import Handoff
from pipeline.kv.mapper import random_mapper
from pipeline.kv.router import Router
from pipeline.kv.scores import FEATURES, SCORES, jensen_shannon
from pipeline.kv.scoring import score_continuations
from pipeline.lm_eval_model import KVTransferLM

VOCAB = 97


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def models(request):
    """The tiny pair, Qwen3-shaped and Llama (helpers.ARCHITECTURES): every gate test runs on both."""
    config = ARCHITECTURES[request.param]
    return build_model(config(VOCAB, 64), seed=1), build_model(config(VOCAB, 32), seed=2)


@pytest.fixture(scope="module")
def handoffs(models):
    target, source = models
    maps = [random_mapper(source.config, target.config, k=k, seed=k) for k in (1, 2)]
    return [Handoff(target, source, "mapped", mapper) for mapper in maps]


def _contexts(count=6, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(2, 30, (1,), generator=generator)),),
                          generator=generator).tolist() for _ in range(count)]


def _probe() -> Probe:
    """A probe over every feature with fixed weights: the `probe` score's path without a fit."""
    count = len(FEATURES)
    return Probe(FEATURES, [0.0] * count, [1.0] * count, [0.5, -0.2, 1.0, 2.0, -1.0, 0.3][:count], 0.1)


def _requests(contexts, endings=2, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(None, context, torch.randint(0, VOCAB, (3,), generator=generator).tolist())
            for context in contexts for _ in range(endings)]


def test_scores_are_computed_without_the_target_prefilling_the_prompt(models, handoffs, monkeypatch):
    target, _ = models
    body = target.model.forward

    def one_token_only(*args, input_ids=None, **kwargs):
        if input_ids is not None and input_ids.shape[1] > 1:
            raise AssertionError("the target prefilled the prompt")
        return body(*args, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(target.model, "forward", one_token_only)
    monkeypatch.setattr(Handoff, "prefix_layers", lambda *args, **kwargs: pytest.fail("prefix_layers was called"))
    scores = Scorer(handoffs[0], tuple(handoffs), _probe()).scores(_contexts(), [*SCORES, *FEATURES], batch_size=4)
    for name in [*SCORES, *FEATURES]:
        assert torch.isfinite(scores[name]).all(), name
        assert name in ("probe", "key_norm", "value_norm") or (scores[name] >= 0).all(), name


def test_scores_of_a_padded_batch_equal_each_context_scored_alone(handoffs):
    scorer, contexts = Scorer(handoffs[0], tuple(handoffs), _probe()), _contexts(seed=3)
    together = scorer.scores(contexts, [*SCORES, *FEATURES], batch_size=len(contexts))
    for row, context in enumerate(contexts):
        alone = scorer.scores([context], [*SCORES, *FEATURES], batch_size=1)
        for name in [*SCORES, *FEATURES]:
            assert alone[name][0].item() == pytest.approx(together[name][row].item(), rel=1e-4, abs=1e-6), name


def test_a_one_token_context_hands_off_nothing_and_scores_minus_infinity(handoffs):
    scores = Scorer(handoffs[0]).scores([[5], [5, 6, 7]], ["entropy"])["entropy"]
    assert scores[0] == float("-inf") and math.isfinite(scores[1])


def test_two_identical_maps_never_disagree(handoffs):
    scores = Scorer(handoffs[0], (handoffs[0], handoffs[0])).scores(_contexts(), ["disagree"])["disagree"]
    assert torch.allclose(scores, torch.zeros_like(scores), atol=1e-6)
    assert jensen_shannon(torch.log_softmax(torch.randn(3, 5), -1), torch.log_softmax(torch.randn(3, 5), -1)).le(
        math.log(2)).all()


def _gated(models, handoffs, threshold, score="entropy"):
    target, _ = models
    gate = Gate(Scorer(handoffs[0], tuple(handoffs)), score, threshold, Handoff(target))
    return KVTransferLM(Router(handoffs[0], gate, batch_size=4), tokenizer=None)


def test_the_gate_at_plus_infinity_is_the_ungated_handoff_and_at_minus_infinity_the_oracle(models, handoffs):
    target, _ = models
    requests = _requests(_contexts(seed=5))
    pairs = [(context, continuation) for _, context, continuation in requests]
    ungated = score_continuations(handoffs[0], pairs, 4, progress=False)
    oracle = score_continuations(Handoff(target), pairs, 4, progress=False)
    for threshold, expected in ((float("inf"), ungated), (float("-inf"), oracle)):
        got = _gated(models, handoffs, threshold)._loglikelihood_tokens(requests, disable_tqdm=True)
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in expected], abs=1e-4)


def test_a_gated_request_gets_the_oracle_exactly_where_its_score_exceeds_the_threshold(models, handoffs):
    target, _ = models
    contexts = _contexts(count=8, seed=7)
    requests = _requests(contexts)
    scores = Scorer(handoffs[0], tuple(handoffs)).scores(contexts, ["kl"])["kl"]
    ordered = scores.sort().values
    # halfway between the two middle scores: torch's median is one of the scores, and the gate scores each request
    # in its own batch, where float32 rounding may put that one a hair either side of it
    threshold = float(ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    lm = _gated(models, handoffs, threshold, "kl")
    got = lm._loglikelihood_tokens(requests, disable_tqdm=True)
    pairs = [(context, continuation) for _, context, continuation in requests]
    ungated = score_continuations(handoffs[0], pairs, 4, progress=False)
    oracle = score_continuations(Handoff(target), pairs, 4, progress=False)
    for index, (_, context, _) in enumerate(requests):
        fell_back = scores[contexts.index(context)].item() > threshold
        assert lm.router.decisions[tuple(context)][1] == fell_back
        assert got[index][0] == pytest.approx((oracle if fell_back else ungated)[index][0], abs=1e-4)
    assert 0 < sum(way for _, way in lm.router.decisions.values()) < len(contexts)


def test_a_gate_must_fall_back_to_the_targets_own_prefill(handoffs):
    with pytest.raises(ValueError, match="oracle"):
        Gate(Scorer(handoffs[0]), "entropy", 0.0, handoffs[1])
    with pytest.raises(ValueError, match="unknown score"):
        Gate(Scorer(handoffs[0]), "perplexity", 0.0, handoffs[1])


def test_a_probe_of_one_class_is_constant_and_its_l2_penalty_shrinks_its_weights():
    values = {"a": np.arange(6.0), "b": np.array([0.0, 1, 0, 1, 0, 1])}
    flat = fit_probe(values, [False] * 6, ("a", "b"), l2=1.0)
    assert flat.weights == [0.0, 0.0] and torch.unique(flat(values)).numel() == 1
    labels = [False, False, True, False, True, True]
    loose, tight = (fit_probe(values, labels, ("a", "b"), l2=l2) for l2 in (0.01, 100.0))
    assert np.linalg.norm(tight.weights) < np.linalg.norm(loose.weights)


def test_a_gate_by_the_probe_needs_a_fitted_probe(handoffs):
    with pytest.raises(ValueError, match="fitted on dev items"):
        Gate(Scorer(handoffs[0]), "probe", 0.0, Handoff(handoffs[0].decoder))
