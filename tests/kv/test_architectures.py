"""Every family the architecture contract accepts, through `Pair.handoff` in every mode it defines and with every
repair policy of the registry: each runs a forward and scores continuations, and a full repair by any policy, or
of every layer, gives the oracle's scores (so the exact layers and each policy's query and key paths are the
model's own, whatever its norms and rotary settings); decoding after the handoff is the model's own greedy decoding."""
import pytest
import torch
from helpers.architectures import SUPPORTED, _requests, random_of

from pipeline.kv.contract import MODES
from pipeline.kv.decode import greedy_rollout
from pipeline.kv.mapper import identity_mapper
from pipeline.kv.pair import Pair
from pipeline.kv.scoring import score_continuations
from pipeline.kv.selectors.registry import POLICIES

REPAIRED_MODES = ("direct", "mapped", "shuffled", "zero")  # the modes that hand the target a cache to repair


@pytest.fixture(scope="module", params=sorted(SUPPORTED))
def pair(request):
    target = random_of(SUPPORTED[request.param]())
    torch.manual_seed(1)
    source = type(target)(target.config).eval()  # same geometry, other weights: every mode is defined
    return Pair.of(target, source), identity_mapper("source", "target", source.config, target.config)


def _scores(pair, mode, mapper, repair=None):
    handoff = pair[0].handoff(mode, mapper, repair=repair)
    return [score for score, _ in score_continuations(handoff, _requests(n_contexts=3, endings=2), progress=False)]


def test_every_mode_runs_and_only_the_oracle_and_direct_agree_where_they_must(pair):
    assert set(pair[0].contract.modes) == set(MODES)
    scores = {mode: _scores(pair, mode, pair[1]) for mode in MODES}
    assert all(torch.isfinite(torch.tensor(values)).all() for values in scores.values())
    assert scores["direct"] == pytest.approx(scores["mapped"], abs=1e-5)  # the identity map moves nothing
    assert scores["mapped"] != pytest.approx(scores["oracle"], abs=1e-3)  # another model's cache


@pytest.mark.parametrize("mode", REPAIRED_MODES)
def test_every_policy_repairs_every_mode_that_hands_off_a_cache(pair, mode):
    for policy in POLICIES:
        scores = _scores(pair, mode, pair[1], f"layers:1+sink:1+tokens:0.5:{policy}")
        assert torch.isfinite(torch.tensor(scores)).all(), policy


@pytest.mark.parametrize("repair", ["layers:2", *(f"tokens:1:{policy}" for policy in POLICIES)])
def test_a_full_repair_gives_the_oracles_scores(pair, repair):
    assert _scores(pair, "mapped", pair[1], repair) == pytest.approx(_scores(pair, "oracle", None), abs=1e-4)


def _plain_greedy(model, context: list[int], steps: int) -> list[int]:
    tokens = list(context)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(context):]


def test_decoding_after_the_oracle_handoff_is_the_models_own_greedy_continuation(pair):
    contexts = [list(range(3, 20)), list(range(40, 49))]
    rolled = greedy_rollout(pair[0].handoff("oracle"), contexts, steps=6)
    assert rolled.tolist() == [_plain_greedy(pair[0].target, context, 6) for context in contexts]
    repaired = greedy_rollout(pair[0].handoff("mapped", pair[1], repair="tokens:1:attention"), contexts, steps=6)
    assert torch.equal(repaired, rolled)
