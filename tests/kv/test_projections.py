"""`kv.projections`, the query/key/value paths of a layer's attention, against what each model the contract accepts
computes itself: its keys and values are the cache the model writes, its queries give the model's own attention
weights; a path that skips a norm the architecture has is caught."""
import pytest
import torch
from helpers.architectures import SUPPORTED, VOCAB, random_of

from pipeline.kv import projections
from pipeline.kv.kvcache import cache_to_layers


def _run(model, ids):
    """The model's forward over ids (1, T), eager, with its attention weights: per layer (attention module, the states
    it read, its cos/sin), the cache and the attention weights (1, Hq, T, T)."""
    captured = []

    def keep(module, args, kwargs, output):
        captured.append((module, kwargs["hidden_states"] if "hidden_states" in kwargs else args[0],
                         kwargs["position_embeddings"]))

    hooks = [layer.self_attn.register_forward_hook(keep, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True, output_attentions=True)
    finally:
        for hook in hooks:
            hook.remove()
    return captured, cache_to_layers(out.past_key_values), out.attentions


@pytest.fixture(scope="module", params=sorted(SUPPORTED))
def seen(request):
    config = SUPPORTED[request.param]()
    config._attn_implementation = "eager"  # the weights themselves, to compare the queries' softmax with
    model = random_of(config)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    return model, _run(model, ids)


def test_keys_and_values_are_the_cache_the_model_writes(seen):
    _, (captured, cache, _) = seen
    for (module, hidden, (cos, sin)), (keys, values) in zip(captured, cache, strict=True):
        assert torch.allclose(projections.rotate(projections.keys(module, hidden), cos, sin), keys, atol=1e-6)
        assert torch.equal(projections.values(module, hidden), values)


def test_queries_over_the_cached_keys_give_the_models_own_attention_weights(seen):
    _, (captured, cache, attentions) = seen
    for (module, hidden, (cos, sin)), (keys, _), weights in zip(captured, cache, attentions, strict=True):
        query = projections.rotate(projections.queries(module, hidden), cos, sin)  # (1, Hq, T, D)
        logits = query @ keys.repeat_interleave(module.num_key_value_groups, dim=1).transpose(2, 3) * module.scaling
        causal = torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
        ours = logits.masked_fill(~causal, -torch.inf).softmax(dim=-1)
        assert torch.allclose(ours, weights, atol=1e-5)


@pytest.mark.parametrize("name", ["olmo2", "qwen3", "qwen3-moe"])  # per head, over all heads, per head
def test_a_path_without_the_key_norm_the_model_has_is_caught(name, monkeypatch):
    model = random_of(SUPPORTED[name]())
    captured, cache, _ = _run(model, torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3)))
    module, hidden, (cos, sin) = captured[0]
    assert torch.allclose(projections.rotate(projections.keys(module, hidden), cos, sin), cache[0][0], atol=1e-6)
    monkeypatch.setattr(module, "k_norm", None)
    assert not torch.allclose(projections.rotate(projections.keys(module, hidden), cos, sin), cache[0][0], atol=1e-3)


def test_the_layer_input_is_the_input_norm_of_a_pre_norm_layer_and_the_stream_itself_in_olmo2():
    layer = random_of(SUPPORTED["olmo2"]()).model.layers[0]
    hidden = torch.randn(1, 3, layer.self_attn.q_proj.in_features)
    assert projections.layer_input(layer, hidden) is hidden
    layer = random_of(SUPPORTED["llama"]()).model.layers[0]
    assert torch.equal(projections.layer_input(layer, hidden), layer.input_layernorm(hidden))
