"""Stored real-model shapes: the configs are Qwen3-0.6B/1.7B's, random models and mappers are well formed."""
import pytest
import torch
from conftest import tiny_config
from transformers import Qwen3ForCausalLM

from pipeline.kv.kvcache import kv_geometry
from pipeline.kv.mapper import random_mapper
from pipeline.store.shapes import pair_configs, random_model, shape_config


@pytest.mark.parametrize("name, hidden, intermediate, parameters", [
    ("qwen3-0.6b", 1024, 3072, 596_049_920),
    ("qwen3-1.7b", 2048, 6144, 1_720_574_976),
])
def test_shape_configs_are_the_public_qwen3_configs(name, hidden, intermediate, parameters):
    config = shape_config(name)
    assert (config.hidden_size, config.intermediate_size) == (hidden, intermediate)
    assert kv_geometry(config) == {"layers": 28, "kv_heads": 8, "head_dim": 128}
    assert (config.num_attention_heads, config.vocab_size, config.max_position_embeddings) == (16, 151936, 40960)
    assert config.rope_parameters == {"rope_theta": 1000000, "rope_type": "default"}
    assert config.rms_norm_eps == 1e-6 and config.tie_word_embeddings
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == parameters  # tied embeddings counted once


def test_unknown_shape_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="qwen3-0.6b"):
        shape_config("qwen3-7b")


def test_random_model_has_tied_weights_of_initializer_scale_and_exact_rotary_buffers():
    config = tiny_config(vocab_size=5000, hidden=64)
    model = random_model(config, seed=3)
    reference = Qwen3ForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    weight = model.model.layers[0].mlp.up_proj.weight
    assert weight.std().item() == pytest.approx(config.initializer_range, rel=0.05)
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    logits = model(torch.arange(10)[None]).logits
    assert torch.isfinite(logits).all()
    assert torch.equal(random_model(config, seed=3).lm_head.weight, model.lm_head.weight)


def test_random_model_is_built_in_the_requested_dtype():
    model = random_model(tiny_config(vocab_size=100, hidden=32), dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.model.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("k, family, weights", [(1, "linear", 58_720_256), (1, "head_matched", 7_340_032),
                                                (4, "linear", 234_881_024)])
def test_random_mapper_has_the_protocol_size_for_the_qwen3_pair(k, family, weights):
    source, target = pair_configs("qwen3-v0")
    mapper = random_mapper(source, target, k, family)
    assert sum(w.numel() for w, _ in mapper.keys + mapper.values) == weights
    assert all(len(chosen) == k and 0 <= min(chosen) and max(chosen) < 28 for chosen in mapper.source_layers)
