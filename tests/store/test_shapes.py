"""Stored real-model shapes: the configs are the public Qwen3 and Llama-3.2 ones, every pair resolves, random
models (Qwen3 and Llama with llama3 RoPE scaling) and mappers are well formed."""
import pytest
import torch
from helpers import tiny_config
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

from pipeline.kv.geometry import kv_geometry
from pipeline.kv.mapper import random_mapper
from pipeline.store.shapes import PAIRS, pair_configs, random_model, shape_config, shape_names

QWEN3 = {"vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
         "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}}
LLAMA32 = {"vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
ARCHITECTURE_OF = {"smollm2": "llama", "qwen2.5": "qwen2"}  # a model family whose name is not its architecture's
QWEN25 = {"vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
          "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}
SMOLLM2 = {"vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
           "rope_parameters": {"rope_theta": 100000, "rope_type": "default"}}
# name: family, (layers, kv_heads, head_dim), heads, hidden, intermediate, tied embeddings, parameters (tied once)
PUBLIC = {
    "qwen3-0.6b": (QWEN3, (28, 8, 128), 16, 1024, 3072, True, 596_049_920),
    "qwen3-1.7b": (QWEN3, (28, 8, 128), 16, 2048, 6144, True, 1_720_574_976),
    "qwen3-4b": (QWEN3, (36, 8, 128), 32, 2560, 9728, True, 4_022_468_096),  # "4.0B"
    "qwen3-8b": (QWEN3, (36, 8, 128), 32, 4096, 12288, False, 8_190_735_360),  # "8.2B"
    "llama-3.2-1b": (LLAMA32, (16, 8, 64), 32, 2048, 8192, True, 1_235_814_400),
    "llama-3.2-3b": (LLAMA32, (28, 8, 128), 24, 3072, 8192, True, 3_212_749_824),
    "smollm2-135m": (SMOLLM2, (30, 3, 64), 9, 576, 1536, True, 134_515_008),  # the converted GGUF's count too
    "smollm2-135m-first9": (SMOLLM2, (9, 3, 64), 9, 576, 1536, True, 134_515_008 - 21 * 3_540_096),
    # the qwen25-coder profile's pair as their GGUFs convert (an output head of their own: untied); the counts are
    # the converted checkpoints'
    "qwen2.5-coder-0.5b": (QWEN25, (24, 2, 64), 14, 896, 4864, False, 630_167_424),
    "qwen2.5-coder-1.5b": (QWEN25, (28, 2, 128), 12, 1536, 8960, False, 1_777_088_000),
}


def tiny_llama_config(vocab_size: int = 300, hidden: int = 64) -> LlamaConfig:
    """Two Llama layers whose llama3 scaling touches every band: with an original context of 64, the first
    frequency is kept, the next two are smoothed and the rest divided by the factor."""
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )


TINY = {"qwen3": lambda: tiny_config(vocab_size=5000, hidden=64), "llama": lambda: tiny_llama_config(5000, 64)}


def test_every_stored_shape_has_its_public_figures():
    assert sorted(PUBLIC) == shape_names()


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_shape_configs_have_the_public_geometry_and_parameter_count(name):
    family, (layers, kv_heads, head_dim), heads, hidden, intermediate, tied, parameters = PUBLIC[name]
    config = shape_config(name)
    family_name = name.split("-")[0]
    assert config.model_type == ARCHITECTURE_OF.get(family_name, family_name)
    assert config._name_or_path == f"shapes/{name}"
    assert kv_geometry(config) == {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
    assert (config.num_attention_heads, config.hidden_size, config.intermediate_size) == (heads, hidden, intermediate)
    assert {key: getattr(config, key) for key in family} == family
    assert config.tie_word_embeddings is tied
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}[config.model_type]
    assert type(model) is expected
    assert sum(p.numel() for p in model.parameters()) == parameters  # tied embeddings counted once


def test_unknown_shape_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="qwen3-0.6b.*llama-3.2-1b|llama-3.2-1b.*qwen3-0.6b"):
        shape_config("qwen3-7b")


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_every_pair_resolves_to_a_larger_target_of_the_same_family_and_vocabulary(pair):
    source, target = pair_configs(pair)
    assert (source.model_type, source.vocab_size) == (target.model_type, target.vocab_size)
    # wider and deeper, or (a self source) as wide and shallower
    sizes = ("hidden_size", "num_hidden_layers", "intermediate_size")
    assert all(getattr(source, name) <= getattr(target, name) for name in sizes)
    assert any(getattr(source, name) < getattr(target, name) for name in sizes)
    assert kv_geometry(source)["layers"] <= kv_geometry(target)["layers"]


def test_llama_pair_has_a_different_kv_geometry_per_side():
    source, target = pair_configs("llama-3.2-1b-3b")
    assert kv_geometry(source) == {"layers": 16, "kv_heads": 8, "head_dim": 64}
    assert kv_geometry(target) == {"layers": 28, "kv_heads": 8, "head_dim": 128}


@pytest.mark.parametrize("family", sorted(TINY))
def test_random_model_has_tied_weights_of_initializer_scale_and_exact_rotary_buffers(family):
    config = TINY[family]()
    model = random_model(config, seed=3)
    reference = AutoModelForCausalLM.from_config(config)
    assert type(model) is type(reference)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    weight = model.model.layers[0].mlp.up_proj.weight
    assert weight.std().item() == pytest.approx(config.initializer_range, rel=0.05)
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    logits = model(torch.arange(10)[None]).logits
    assert torch.isfinite(logits).all()
    assert torch.equal(random_model(config, seed=3).lm_head.weight, model.lm_head.weight)


def test_llama3_scaling_reaches_the_random_models_rotary_buffers():
    plain = tiny_llama_config()
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    scaled = random_model(tiny_llama_config()).model.rotary_emb.inv_freq  # (8,)
    unscaled = random_model(plain).model.rotary_emb.inv_freq
    assert scaled[0] == unscaled[0] and torch.equal(scaled[3:], unscaled[3:] / 8)
    assert (scaled[1:3] < unscaled[1:3]).all() and (scaled[1:3] > unscaled[1:3] / 8).all()


@pytest.mark.parametrize("family", sorted(TINY))
def test_random_model_is_built_in_the_requested_dtype(family):
    model = random_model(TINY[family](), dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.model.rotary_emb.inv_freq.dtype == torch.float32
    reference = AutoModelForCausalLM.from_config(TINY[family]())
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)


@pytest.mark.parametrize("k, family, weights", [(1, "linear", 58_720_256), (1, "head_matched", 7_340_032),
                                                (4, "linear", 234_881_024)])
def test_random_mapper_has_the_protocol_size_for_the_qwen3_pair(k, family, weights):
    source, target = pair_configs("qwen3-v0")
    mapper = random_mapper(source, target, k, family)
    assert sum(w.numel() for w, _ in mapper.keys + mapper.values) == weights
    assert all(len(chosen) == k and 0 <= min(chosen) and max(chosen) < 28 for chosen in mapper.source_layers)


@pytest.mark.parametrize("family, weights", [("linear", 29_360_128), ("head_matched", 3_670_016)])
def test_random_mapper_bridges_the_llama_pairs_head_dims(family, weights):
    source, target = pair_configs("llama-3.2-1b-3b")
    mapper = random_mapper(source, target, 1, family)
    assert sum(w.numel() for w, _ in mapper.keys + mapper.values) == weights  # 2 x 28 x 8 x (512 | 64) x 128
    assert mapper.keys[0][0].shape[-1] == 128 and all(max(chosen) < 16 for chosen in mapper.source_layers)
