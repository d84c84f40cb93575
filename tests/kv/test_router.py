"""The router (`kv.router`): each context's handoff and route, decided once; a gated context that keeps its map
prefilled and mapped once; scores equal to the handoff's own or the oracle's."""
import pytest
from helpers.architectures import SUPPORTED, _full_forward_scores, _requests, random_of

from pipeline.kv.pair import Pair
from pipeline.kv.router import Router
from pipeline.kv.routes import EMPTY_PREFIX, FELL_BACK
from pipeline.kv.scoring import score_continuations

MAX_LENGTH = 512


@pytest.fixture(scope="module")
def pair(tiny_pair) -> Pair:
    return Pair(str(tiny_pair["target"]), str(tiny_pair["source"]), "float32", "cpu")


@pytest.fixture(scope="module")
def requests(tokenizer) -> list[tuple[list[int], list[int]]]:
    """Six contexts, two continuations each, and a one-token context (it hands nothing off)."""
    texts = ["A man is sitting on a roof.", "Question: How do I open a jar?\nAnswer:", "The dog ran after",
             "She opened the door and", "Two players shake hands before", "To boil water, put the pot"]
    contexts = [tokenizer.encode(text) for text in texts] + [tokenizer.encode("Question")[:1]]
    return [(context, tokenizer.encode(ending, add_special_tokens=False)) for context in contexts
            for ending in (" then it rained.", " and left.")]


def distinct_handed_off(requests) -> int:
    return len({tuple(context) for context, _ in requests if len(context) >= 2})


@pytest.mark.parametrize("threshold", [float("inf"), float("-inf")])
def test_a_gated_context_is_prefilled_and_mapped_once_for_its_score_and_its_continuations(pair, requests,
                                                                                          threshold):
    handoff = pair.handoff("direct")
    router = Router(handoff, pair.gate(handoff, "entropy", threshold), batch_size=4)
    results, routes = router.score(requests, MAX_LENGTH, progress=False)
    # once by the gate's scorer; a context that keeps its map is scored on that cache, one that falls back by the
    # oracle (before the kept maps, twice: the scorer's prefill and map, then the handoff's again)
    assert handoff.inputs.source_prefills == distinct_handed_off(requests)
    alone = Router(pair.handoff("direct" if threshold > 0 else "oracle"), batch_size=4)
    expected, _ = alone.score(requests, MAX_LENGTH, progress=False)
    assert [ll for ll, _ in results] == pytest.approx([ll for ll, _ in expected], abs=1e-4)
    kept = "direct" if threshold > 0 else FELL_BACK
    assert [route.way for route in routes] == [kept if len(context) >= 2 else EMPTY_PREFIX if threshold > 0
                                               else FELL_BACK for context, _ in requests]
    assert not hasattr(handoff, "kept_maps")  # the router holds the gate's caches, a batch at a time


def test_the_gates_decisions_are_memoised_per_context(pair, requests):
    handoff = pair.handoff("direct")
    router = Router(handoff, pair.gate(handoff, "entropy", 0.0), batch_size=4)
    contexts = [context for context, _ in requests]
    first = router.routes(contexts)
    prefilled = handoff.inputs.source_prefills
    assert router.routes(contexts) == first and handoff.inputs.source_prefills == prefilled


def test_an_ungated_router_scores_as_the_scoring_core_does(pair, requests):
    handoff = pair.handoff("direct")
    results, routes = Router(handoff, batch_size=4).score(requests, MAX_LENGTH, progress=False)
    assert results == score_continuations(pair.handoff("direct"), requests, 4, MAX_LENGTH, progress=False)
    assert {route.way for route in routes} == {"direct", EMPTY_PREFIX}


def test_a_stages_request_reaches_its_handoff_the_truncated_prompt_included(pair, requests):
    truncated = pair.router(mode="oracle", keep=0.5, batch_size=4)
    assert truncated.handoff.keep == 0.5 and truncated.record()["transfer"] == "oracle"
    results, _ = truncated.score(requests, MAX_LENGTH, progress=False)
    assert results == score_continuations(pair.handoff("oracle", keep=0.5), requests, 4, MAX_LENGTH, progress=False)
    assert results != score_continuations(pair.handoff("oracle"), requests, 4, MAX_LENGTH, progress=False)


@pytest.mark.parametrize("architecture", sorted(SUPPORTED))
def test_a_truncated_prompt_request_scores_the_kept_tail_as_a_full_forward_on_every_supported_architecture(
        architecture):
    model = random_of(SUPPORTED[architecture]())
    router = Pair.of(model).router(mode="oracle", keep=0.5, batch_size=4)
    requests = _requests()
    results, _ = router.score(requests, model.config.max_position_embeddings, progress=False)
    tails = [(context[-max(1, round(0.5 * len(context))):], continuation) for context, continuation in requests]
    assert [score for score, _ in results] == pytest.approx(_full_forward_scores(model, tails), abs=1e-4)
