"""The handoff's modes under the last-token protocol: exactness, identity path, nulls, batching, refusals, a
device map, and the first step."""
from dataclasses import replace

import pytest
import torch
from helpers import ARCHITECTURES, build_model, periodic_batch, tiny_config
from helpers.architectures import _full_forward_scores, _requests

from pipeline.kv.contract import pair_contract
from pipeline.kv.decode import decode, greedy_rollout, read_after, teacher_forced
from pipeline.kv.handoff import Handoff
from pipeline.kv.kvcache import cache_to_layers, layers_to_cache, padded_prefixes
from pipeline.kv.mapper import identity_mapper, map_cache, random_mapper
from pipeline.kv.modes import own_prefill, rebuilt, shuffle_order
from pipeline.kv.rope import Rotation
from pipeline.kv.scoring import score_continuations
from pipeline.store.models import load_model

VOCAB = 97


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def architecture(request) -> str:
    """Each test of the tiny pair runs on the Qwen3-shaped pair and the Llama one (helpers.ARCHITECTURES)."""
    return request.param


@pytest.fixture(scope="module")
def target(architecture):
    return build_model(ARCHITECTURES[architecture](VOCAB, 64), seed=1)


@pytest.fixture(scope="module")
def source(architecture):
    return build_model(ARCHITECTURES[architecture](VOCAB, 32), seed=2)


def test_oracle_handoff_matches_full_forward(target):
    requests = _requests()
    results = score_continuations(Handoff(target), requests, batch_size=2, progress=False)
    for (score, _), reference in zip(results, _full_forward_scores(target, requests)):
        assert score == pytest.approx(reference, abs=1e-4)


def test_at_batch_1_the_oracle_prefills_and_scores_each_context_in_one_forward_as_the_full_forward(target):
    requests = _requests(seed=3)
    calls = []
    hook = target.model.register_forward_hook(lambda *_: calls.append(1))  # the body: once per forward
    try:
        results = score_continuations(Handoff(target), requests, batch_size=1, progress=False)
        one = len(calls)
        score_continuations(Handoff(target), requests, batch_size=2, progress=False)
    finally:
        hook.remove()
    contexts = len({tuple(context) for context, _ in requests})
    assert one == contexts and len(calls) - one > contexts  # batch 2: a prefill and a step per batch
    for (score, _), reference in zip(results, _full_forward_scores(target, requests)):
        assert score == pytest.approx(reference, abs=1e-4)


def test_direct_with_source_equal_to_target_matches_oracle(target):
    requests = _requests(seed=1)
    oracle = score_continuations(Handoff(target), requests, progress=False)
    direct = score_continuations(Handoff(target, target, "direct"), requests, progress=False)
    assert direct == oracle


def test_identity_mapper_through_strip_map_apply_reproduces_direct(target, source):
    requests = _requests(seed=2)
    direct = score_continuations(Handoff(target, source, "direct"), requests, progress=False)
    mapper = identity_mapper("source", "target", source.config, target.config)
    mapped = score_continuations(Handoff(target, source, "mapped", mapper), requests, progress=False)
    for (a, greedy_a), (b, greedy_b) in zip(direct, mapped):
        assert a == pytest.approx(b, abs=1e-4)
        assert greedy_a == greedy_b


def test_a_map_fitted_on_rotated_keys_reads_and_writes_them_as_cached(source):
    other_rope = build_model(tiny_config(VOCAB, 64, rope_theta=500.0), seed=1)  # the same KV geometry
    stripped = identity_mapper("source", "target", source.config, other_rope.config)
    rotated = replace(stripped, key_space="rotated")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    cached = own_prefill(source, ids)
    as_cached = rebuilt(Handoff(other_rope, source, "mapped", rotated).inputs, cached, rotated)
    re_rotated = rebuilt(Handoff(other_rope, source, "mapped", stripped).inputs, cached, stripped)
    assert all(torch.equal(out, keys) for (out, _), (keys, _) in zip(as_cached, cached))
    # the pipeline's map strips the source's RoPE and applies the target's, here another theta
    assert not any(torch.allclose(out, keys, atol=1e-3) for (out, _), (keys, _) in zip(re_rotated, cached))


def test_shared_context_costs_one_source_prefill(target, source):
    handoff = Handoff(target, source, "direct")
    requests = _requests(n_contexts=5, endings=4, seed=3)
    score_continuations(handoff, requests, batch_size=3, progress=False)
    assert handoff.inputs.source_prefills == 5 and handoff.inputs.source_forwards == 5  # batch 3 < 4 endings: one each


def test_null_controls_really_replace_the_cache(periodic_model):
    sequences = periodic_batch(torch.Generator().manual_seed(1), 24, 30, 32).tolist()
    requests = [(s[:24], s[24:]) for s in sequences]

    def mean(mode: str) -> float:
        scores = score_continuations(Handoff(periodic_model, periodic_model, mode), requests, progress=False)
        return sum(score for score, _ in scores) / len(requests)

    oracle, zero, shuffled = mean("oracle"), mean("zero"), mean("shuffled")
    assert oracle > -0.5 * 6 * 2  # the model did learn to use the prefix (< 2 nats per token)
    assert zero < oracle - 3.0
    assert shuffled < oracle - 3.0


def test_shuffled_is_seeded(periodic_model):
    requests = [(list(range(1, 20)), [5, 6])]

    def run(seed: int) -> list:
        return score_continuations(Handoff(periodic_model, periodic_model, "shuffled", shuffle_seed=seed), requests,
                                   progress=False)

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_greedy_generation_from_oracle_cache_matches_plain_greedy(target):
    context = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    tokens = decode(Handoff(target), context, max_new_tokens=8)
    expected, sequence = [], list(context)
    for _ in range(8):
        with torch.no_grad():
            token = int(target(torch.tensor([sequence])).logits[0, -1].argmax())
        expected.append(token)
        sequence.append(token)
    assert tokens == expected


def test_a_vocabulary_size_difference_alone_leaves_the_tokenizers_unchecked_not_different(target):
    other = build_model(tiny_config(VOCAB + 1, 32), seed=4)  # an embedding padded past the vocabulary, as Qwen2.5-7B's
    contract = pair_contract(target.config, other.config)
    assert contract.tokenizers == "unchecked" and f"vocabulary sizes {VOCAB + 1} vs {VOCAB}" in contract.tokenizer_note


@pytest.mark.parametrize("mode", ["oracle", "direct", "mapped", "zero", "shuffled"])
def test_batched_contexts_of_different_lengths_score_as_one_at_a_time(target, mode):
    requests = _requests(n_contexts=6, endings=3, seed=7)  # contexts of 2..39 tokens
    assert len({len(c) for c, _ in requests}) > 1
    source = build_model(tiny_config(VOCAB, 64), seed=9)  # same geometry, other weights
    mapper = identity_mapper("source", "target", source.config, target.config) if mode == "mapped" else None

    def make() -> Handoff:
        return Handoff(target, source, mode, mapper) if mode not in ("oracle", "zero") else Handoff(target, mode=mode)

    one = score_continuations(make(), requests, batch_size=1, progress=False)
    batched_handoff = make()
    batched = score_continuations(batched_handoff, requests, batch_size=9, progress=False)
    assert [s for s, _ in batched] == pytest.approx([s for s, _ in one], abs=1e-4)
    assert [g for _, g in batched] == [g for _, g in one]
    if mode not in ("oracle", "zero"):
        counted = batched_handoff.inputs
        assert counted.source_prefills == 6 and counted.source_forwards == 2  # 3 contexts a forward


def test_a_cache_built_for_a_model_spread_over_devices_puts_each_layer_on_its_own(target):
    layers = [(torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16)) for _ in range(target.config.num_hidden_layers)]
    devices = [torch.device("cpu")] * (len(layers) - 1) + [torch.device("meta")]
    cache = layers_to_cache(layers, target.config, torch.float32, devices)
    assert [layer.keys.device.type for layer in cache.layers] == [d.type for d in devices]
    assert cache.layers[-1].values.device.type == "meta"


def test_a_checkpoint_loaded_with_a_device_map_scores_as_the_model_on_one_device(target, tmp_path):
    target.save_pretrained(tmp_path / "target")
    whole = load_model(str(tmp_path / "target"), device="cpu")
    mapped = load_model(str(tmp_path / "target"), device_map="auto")  # this CPU: accelerate keeps it on one device
    requests = _requests(n_contexts=2, endings=2)
    assert score_continuations(Handoff(mapped), requests, 4) == score_continuations(Handoff(whole), requests, 4)


@pytest.mark.parametrize("mode", ["mapped", "shuffled"])
def test_map_cache_with_autograd_builds_the_handoffs_cache_bit_for_bit_and_carries_the_gradient(target, source, mode):
    mapper, prefix = random_mapper(source.config, target.config, k=1), 9
    ids = torch.randint(0, VOCAB, (2, prefix), generator=torch.Generator().manual_seed(4))
    handoff = Handoff(target, source, mode, mapper, shuffle_seed=3)
    handed = handoff.prefix_layers(ids)  # under no_grad
    with torch.no_grad():
        cached = cache_to_layers(source.model(input_ids=ids, use_cache=True).cache)
    rotation = Rotation(handoff.inputs.source_spec, torch.arange(prefix))
    content = [(rotation.strip(k.float()), v.float()) for k, v in cached]
    trained = replace(mapper, keys=[tuple(torch.nn.Parameter(t.clone()) for t in ts) for ts in mapper.keys],
                      values=[tuple(torch.nn.Parameter(t.clone()) for t in ts) for ts in mapper.values])
    order = shuffle_order(3, prefix, torch.full((2,), prefix)) if mode == "shuffled" else None
    layers = list(map_cache(trained, content, Rotation(handoff.decoder_spec, torch.arange(prefix)), target.dtype,
                            "cpu", order))
    for (keys, values), (_, (keys_built, values_built)) in zip(handed, layers, strict=True):
        assert torch.equal(keys, keys_built) and torch.equal(values, values_built)
    sum(keys.sum() + values.sum() for _, (keys, values) in layers).backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for ts in trained.keys + trained.values for t in ts)


@pytest.mark.parametrize("mode", ["oracle", "direct", "zero"])
def test_the_first_step_is_the_prefix_cache_then_the_step_on_the_last_token_and_decoding_continues_from_it(
        target, mode):
    contexts = [list(range(3, 17)), list(range(20, 26)), [40]]  # padded rows, and a one-token context
    handoff = Handoff(target, target if mode == "direct" else None, mode)
    prefixes = padded_prefixes(contexts)
    told = []
    first = handoff.first_step(prefixes, told.append)
    assert told == {"oracle": ["prefill", "step"], "direct": ["prefill", "map", "step"],
                    "zero": ["map", "step"]}[mode]
    layers = handoff.prefix_layers(prefixes.ids, prefixes.padded_lengths)
    stepped = handoff.step_logprobs(layers, prefixes.last, prefixes.padded_lengths)[:, -1]  # (B, V)
    assert torch.allclose(first.logprobs, stepped, atol=1e-5)
    assert all(torch.equal(layer.keys[:, :, :-1], keys) for layer, (keys, _) in zip(first.cache.layers, layers))
    assert first.selected is None  # nothing computed by a choice: its own prefill, a bare cache
    if mode != "zero":  # the target's own next-token distribution after the whole context
        with torch.no_grad():
            plain = [torch.log_softmax(target(torch.tensor([c])).logits[0, -1].float(), -1) for c in contexts]
        assert torch.allclose(first.logprobs, torch.stack(plain), atol=1e-4)
    alone = handoff.first_step(padded_prefixes(contexts[:1]))
    logprobs, rollout = read_after(handoff, alone, [50, 51, 52], 4)  # teacher-forced, then cropped back: greedy
    assert torch.allclose(logprobs, teacher_forced(handoff, [(contexts[0], [50, 51, 52])])[0], atol=1e-4)
    assert rollout.tolist() == greedy_rollout(handoff, contexts[:1], 4)[0].tolist()
