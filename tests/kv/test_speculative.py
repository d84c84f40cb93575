"""Speculative prefill (`speculative:P`, `kv.lookahead`, `kv.modes.Speculative`): the source scores the
prefix's positions by its look-ahead attention, the target prefills the kept ones at their own positions and reads
on from that sparse cache. On every architecture the contract accepts, with a source of another depth (unequal
geometry: no map, and none needed): p = 1 is the oracle exactly; at p < 1 each kept token sits at its original
position (a renumbered forward differs) and every read after the cache (scoring, a padded batch, decoding) is told
the true positions; the choice is deterministic and always keeps the sinks and the last m; the FLOP model counts the
source's prefill, its scores and the target's prefill of the kept tokens only."""
import math

import pytest
import torch
from helpers import committed
from helpers.architectures import SUPPORTED, VOCAB, _requests, random_of
from lm_eval.api.instance import Instance

from pipeline import api, generate
from pipeline.kv import flops
from pipeline.kv.decode import decode, greedy_rollout
from pipeline.kv.kvcache import Prefixes
from pipeline.kv.lookahead import keep_positions
from pipeline.kv.modes import Prompt, source_prefill
from pipeline.kv.pair import Pair
from pipeline.kv.scoring import score_continuations
from pipeline.kv.speculative import SpeculativeParams
from pipeline.lm_eval_model import KVTransferLM
from pipeline.store.params import ParamError, parse
from pipeline.store.shapes import pair_configs

LOOKAHEAD = parse(SpeculativeParams, committed("speculative", last=3, sinks=2), "speculative")


@pytest.fixture(scope="module", params=sorted(SUPPORTED))
def pair(request) -> Pair:
    target = random_of(SUPPORTED[request.param]())
    config = SUPPORTED[request.param]()
    config.num_hidden_layers = 3  # another depth: direct injection and the identity map are undefined
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1] * 3
    torch.manual_seed(1)
    source = type(target)(config).eval()
    return Pair.of(target, source)


def _speculative(pair: Pair, share: float):
    return pair.handoff("speculative", share=share, speculative=LOOKAHEAD)


def _contexts(seed: int = 0, lengths=(24, 17)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def test_the_pair_is_of_unequal_geometry_so_only_modes_without_a_map_of_it_are_defined(pair):
    assert pair.contract.defined("speculative") and not pair.contract.defined("direct")


def test_at_share_1_speculative_prefill_is_the_oracle_exactly(pair):
    oracle, full = pair.handoff("oracle"), _speculative(pair, 1.0)
    contexts = torch.tensor(_contexts(lengths=(20, 20)))
    assert torch.equal(full.first_step(Prefixes.of(contexts)).logits, oracle.first_step(Prefixes.of(contexts)).logits)
    requests = _requests(n_contexts=3, endings=2)
    assert score_continuations(full, requests, progress=False) == score_continuations(oracle, requests, progress=False)
    assert torch.equal(greedy_rollout(full, _contexts(), 4), greedy_rollout(oracle, _contexts(), 4))


def _kept(handoff, context: list[int]) -> torch.Tensor:
    """(K,) the positions the handoff keeps of `context`'s prefix, from its own scores."""
    prefix = torch.tensor([context[:-1]])  # (1, P)
    _, scores = source_prefill(handoff.inputs, Prompt(prefix), scored=True)
    return keep_positions(scores, torch.tensor([prefix.shape[1]]), LOOKAHEAD, handoff.share)[0]


def _reference_logits(target, context: list[int], kept: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The target's logits (V,) at c[n-1] from one plain forward over the kept tokens and c[n-1] at `positions`."""
    ids = torch.tensor([[context[p] for p in kept.tolist()] + [context[-1]]])  # (1, K + 1)
    with torch.no_grad():
        return target(input_ids=ids, position_ids=positions[None], attention_mask=torch.ones_like(ids)).logits[0, -1]


def test_each_kept_token_sits_at_its_original_position_and_a_renumbered_cache_differs(pair):
    handoff, context = _speculative(pair, 0.3), _contexts()[0]
    kept = _kept(handoff, context)
    prefix = len(context) - 1
    assert len(kept) < prefix and kept.tolist() != list(range(len(kept)))  # a sparse choice, with gaps
    logits = handoff.first_step(Prefixes.of(torch.tensor([context]))).logits[0]  # (V,)
    true = _reference_logits(pair.target, context, kept, torch.cat([kept, torch.tensor([prefix])]))
    renumbered = _reference_logits(pair.target, context, kept, torch.arange(len(kept) + 1))
    assert torch.allclose(logits, true, atol=1e-4)
    assert not torch.allclose(logits, renumbered, atol=1e-3)


def test_decoding_after_the_sparse_cache_goes_on_at_the_true_positions(pair):
    handoff, context = _speculative(pair, 0.3), _contexts()[0]
    kept, prefix = _kept(handoff, context), len(context) - 1
    tokens, positions = [context[p] for p in kept.tolist()] + [context[-1]], kept.tolist() + [prefix]
    expected = []
    with torch.no_grad():
        for _ in range(4):
            logits = pair.target(input_ids=torch.tensor([tokens]), position_ids=torch.tensor([positions])).logits
            expected.append(int(logits[0, -1].argmax()))
            tokens, positions = tokens + expected[-1:], positions + [positions[-1] + 1]
    assert decode(handoff, context, 4) == expected
    assert greedy_rollout(handoff, [context], 4)[0].tolist() == expected


def test_a_padded_batch_scores_each_context_as_it_scores_alone(pair):
    handoff, requests = _speculative(pair, 0.4), _requests(n_contexts=4, endings=2)
    batched = score_continuations(handoff, requests, batch_size=8, progress=False)
    alone = score_continuations(handoff, requests, batch_size=1, progress=False)
    assert [score for score, _ in batched] == pytest.approx([score for score, _ in alone], abs=1e-4)
    assert batched != score_continuations(pair.handoff("oracle"), requests, progress=False)


def test_the_choice_is_deterministic_and_always_keeps_the_sinks_and_the_last_m():
    generator = torch.Generator().manual_seed(3)
    scores = torch.rand(2, 30, generator=generator)  # (B, P)
    scores[:, :2] = scores[:, -3:] = -1.0  # the sinks and the last m scored lowest: kept all the same
    scores[0, 10] = scores[0, 11] = 5.0  # a tie: both kept at 2 of 25
    lengths = torch.tensor([30, 21])
    kept = keep_positions(scores, lengths, LOOKAHEAD, 0.08)
    assert torch.equal(kept, keep_positions(scores.clone(), lengths, LOOKAHEAD, 0.08))
    assert kept[0].tolist() == [0, 1, 10, 11, 27, 28, 29]
    row = [p for p in kept[1].tolist() if p >= 0]
    assert row[:2] == [0, 1] and row[-3:] == [18, 19, 20] and len(row) == LOOKAHEAD.kept(0.08, 21)
    scores[0, 12] = 5.0  # a three-way tie at two places: the earlier positions win
    assert keep_positions(scores, lengths, LOOKAHEAD, 0.08)[0].tolist() == [0, 1, 10, 11, 27, 28, 29]


def test_the_kept_count_is_the_sinks_the_last_m_and_the_rounded_share_of_the_rest():
    assert [LOOKAHEAD.kept(share, 25) for share in (0.0, 0.1, 0.5, 1.0)] == [5, 7, 15, 25]
    assert LOOKAHEAD.kept(0.5, 4) == 4 and LOOKAHEAD.kept(0.5, 1) == 1  # sinks and last cut to the prefix


def test_the_flop_model_counts_the_sources_prefill_its_scores_and_the_kept_tokens_only():
    source, target = pair_configs("qwen3-v0")
    length, prefix = 1024, 1023
    parts = flops.speculative_macs(source, target, LOOKAHEAD, 0.1, length)
    kept = LOOKAHEAD.kept(0.1, prefix)
    assert parts["source"] == flops.handoff_macs(source, target, 0, length)["source"]
    assert parts["target"] == kept * flops.linear_macs_per_token(target) + flops.attention_macs(target, 0, kept)
    assert parts["step"] == (flops.linear_macs_per_token(target) + flops.attention_macs(target, kept, kept + 1)
                             + flops.logits_macs(target))
    width = source.num_attention_heads * source.head_dim
    keys_read = prefix + (prefix - 1) + (prefix - 2)  # the last 3 queries, each over the keys up to itself
    assert parts["scores"] == source.num_hidden_layers * (3 * source.hidden_size * width + width * keys_read)
    one = flops.speculative_macs(source, target, LOOKAHEAD, 1.0, length)
    assert one["target"] + one["step"] == flops.target_prefill_macs(target, length)  # p = 1: the oracle's work
    bounds = [flops.speculative_bound(source, target, LOOKAHEAD, share, length) for share in (0.1, 0.5, 1.0)]
    assert bounds[0] > bounds[1] > 1 > bounds[2]  # p = 1 pays the source on top of the oracle


def test_the_layers_read_are_checked_against_the_source():
    last_two = parse(SpeculativeParams, committed("speculative", layers=[0, -1]), "speculative")
    assert last_two.layer_indices(4) == [0, 3] and LOOKAHEAD.layer_indices(3) == [0, 1, 2]
    assert last_two.layer_refusal(4) is None
    assert "layer -1" not in (last_two.layer_refusal(1) or "") and "outside the source's 1 layers" in \
        parse(SpeculativeParams, committed("speculative", layers=[2]), "speculative").layer_refusal(1)
    with pytest.raises(ParamError, match=r"speculative.layers"):
        parse(SpeculativeParams, committed("speculative", layers=[]), "speculative")


def test_every_face_reaches_it_by_its_written_value(pair, tiny_pair):
    router = api.handoff(pair, "speculative:0.5")
    assert router.record()["transfer"] == "speculative:0.5" and router.handoff.share == 0.5
    prompt = _contexts()[0]
    handed = api.handed_off(router, prompt)
    first = router.handoff.first_step(Prefixes.of(torch.tensor([prompt])))
    assert torch.allclose(handed.next_token_logits(), first.logits[0], atol=1e-5)
    routers = generate.build_routers(pair, ["speculative:0.5"], {}, asked=True)
    assert list(routers) == ["oracle", "speculative:0.5"] and routers["speculative:0.5"].handoff.share == 0.5
    lm = KVTransferLM.from_args(target=str(tiny_pair["target"]), source=str(tiny_pair["source"]),
                                transfer="speculative:0.5", device="cpu")
    assert lm.router.record()["transfer"] == "speculative:0.5"
    requests = [Instance("loglikelihood", {}, ("a b c d e f g h i j k l", " m n"), 0)]
    (score, _), = lm.loglikelihood(requests, disable_tqdm=True)
    assert math.isfinite(score)
