"""The router (`kv.router`): each request's route; each context prefilled and mapped once for its continuations;
scores and first steps equal to the handoff's own; the record of the handoff it serves."""
import pytest
import torch
from helpers.architectures import SUPPORTED, _full_forward_scores, _requests, random_of

from pipeline.kv.kvcache import padded_prefixes
from pipeline.kv.pair import Pair
from pipeline.kv.repair import Repair
from pipeline.kv.router import Router
from pipeline.kv.routes import EMPTY_PREFIX, REPAIRED, Route
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


def test_a_router_scores_as_the_scoring_core_does_prefilling_and_mapping_each_context_once(pair, requests):
    handoff = pair.handoff("direct")
    results, routes = Router(handoff, batch_size=4).score(requests, MAX_LENGTH, progress=False)
    assert handoff.inputs.source_prefills == distinct_handed_off(requests)  # once for both its continuations
    assert results == score_continuations(pair.handoff("direct"), requests, 4, MAX_LENGTH, progress=False)
    assert [route.way for route in routes] == ["direct" if len(context) >= 2 else EMPTY_PREFIX
                                               for context, _ in requests]


def test_a_routers_first_step_is_its_handoffs_on_the_context_and_its_route(pair, requests):
    router = Router(pair.handoff("direct"), batch_size=4)
    for context in (requests[0][0], requests[-1][0]):  # handed off, and a one-token context
        first, route = router.first_step(context)
        alone = pair.handoff("direct").first_step(padded_prefixes([context]))
        assert torch.allclose(first.logits, alone.logits, atol=1e-6)
        assert route == Route("direct" if len(context) >= 2 else EMPTY_PREFIX) == router.route(context)


def test_a_routers_record_names_its_transfer_and_repair_and_a_repaired_router_sends_requests_as_repaired(pair):
    plain = pair.router(mode="direct")
    assert plain.record() == {"transfer": "direct", "repair": "none"} and plain.ways() == ["direct", EMPTY_PREFIX]
    repaired = pair.router(mode="direct", repair=Repair.parse("sink:2"))
    assert repaired.record() == {"transfer": "direct", "repair": "sink:2"}
    assert repaired.ways() == [REPAIRED, EMPTY_PREFIX] and repaired.route([5, 6]) == Route(REPAIRED)


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
