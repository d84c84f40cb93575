"""RoPE strip/apply: round trips, agreement with the model's own rotation, unsupported settings."""
import pytest
import torch
from helpers import build_model, tiny_config
from helpers.architectures import SUPPORTED, VOCAB, config_of, random_of
from transformers import Qwen3Config

from pipeline.controls import rope_against_model
from pipeline.kv.handoff import Handoff
from pipeline.kv.kvcache import cache_to_layers
from pipeline.kv.rope import RotarySpec, Rotation, UnsupportedRopeError

QWEN3_ROPE = RotarySpec.default(theta=1_000_000.0, head_dim=128, max_positions=40960)


@pytest.mark.parametrize("spec", [QWEN3_ROPE, RotarySpec.default(10000.0, 16, 512)], ids=["qwen3", "tiny"])
def test_strip_then_apply_is_identity_up_to_max_positions(spec):
    torch.manual_seed(0)
    positions = torch.arange(spec.max_positions)
    keys = torch.randn(1, 2, spec.max_positions, spec.head_dim)
    round_trip = Rotation(spec, positions).apply(Rotation(spec, positions).strip(keys))
    assert (round_trip - keys).abs().max().item() < 1e-5
    assert (Rotation(spec, positions).strip(Rotation(spec, positions).apply(keys)) - keys).abs().max().item() < 1e-5


def test_prefix_of_a_long_rotation_is_the_short_rotation():
    keys = torch.randn(3, 2, 40, QWEN3_ROPE.head_dim)
    long = Rotation(QWEN3_ROPE, torch.arange(100))
    assert torch.equal(long.first(40).strip(keys), Rotation(QWEN3_ROPE, torch.arange(40)).strip(keys))
    assert torch.equal(long.first(40).apply(keys), Rotation(QWEN3_ROPE, torch.arange(40)).apply(keys))
    with pytest.raises(ValueError, match="101 tokens but this rotation covers 100"):
        long.first(101)


def test_bfloat16_round_trip_compared_in_float32_after_the_cast():
    torch.manual_seed(0)
    positions = torch.arange(2048)
    keys = torch.randn(1, 8, 2048, 128).to(torch.bfloat16)
    content = Rotation(QWEN3_ROPE, positions).strip(keys.float())
    back = Rotation(QWEN3_ROPE, positions).apply(content).to(torch.bfloat16)
    # one bfloat16 rounding of the result, nothing more
    assert ((back.float() - keys.float()).abs() <= keys.float().abs() * 2**-8 + 1e-6).all()


def test_strip_of_cached_key_equals_k_norm_output():
    model = build_model(tiny_config(97, 64), seed=0)
    captured = {}
    hooks = [
        layer.self_attn.k_norm.register_forward_hook(lambda m, i, o, idx=idx: captured.__setitem__(idx, o))
        for idx, layer in enumerate(model.model.layers)
    ]
    ids = torch.randint(0, 97, (1, 200))
    with torch.no_grad():
        cache = model.model(input_ids=ids, use_cache=True).cache
    for hook in hooks:
        hook.remove()
    spec = RotarySpec.from_config(model.config)
    positions = torch.arange(200)
    for idx, (keys, _) in enumerate(cache_to_layers(cache)):
        before_rope = captured[idx].transpose(1, 2)  # k_norm output (B, T, H, D) -> (B, H, T, D)
        assert (Rotation(spec, positions).strip(keys) - before_rope).abs().max().item() < 1e-5
        assert (keys - before_rope).abs().max().item() > 1e-2  # the cache really was rotated


def test_spec_reads_qwen3_config():
    config = Qwen3Config(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         rope_theta=1_000_000.0, max_position_embeddings=40960)
    assert RotarySpec.from_config(config) == QWEN3_ROPE


def test_length_dependent_rope_type_fails_clearly():
    config = tiny_config(97, 64)
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(UnsupportedRopeError, match="length-dependent RoPE"):
        RotarySpec.from_config(config)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_supported_familys_rotary_spec_strips_exactly_what_the_model_rotated(name):
    model = random_of(SUPPORTED[name]())
    prompts = [torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(1)).tolist()]
    result = rope_against_model(model, prompts, RotarySpec.from_model(model), 1e-5)
    assert result["passed"], result


def test_a_model_cast_to_bfloat16_after_loading_is_refused_naming_its_inv_freq():
    model = random_of(SUPPORTED["llama"]()).to(torch.bfloat16)
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    with pytest.raises(UnsupportedRopeError, match="bfloat16 inv_freq"):
        Handoff(model)


def test_scaled_rope_spec_carries_the_models_frequencies_and_attention_factor():
    config = SUPPORTED["llama-yarn"]()
    model = random_of(config)
    spec = RotarySpec.from_model(model)
    assert spec.attention_scaling == pytest.approx(model.model.rotary_emb.attention_scaling) != 1.0
    assert torch.equal(spec.inv_freq("cpu"), model.model.rotary_emb.inv_freq)
    assert spec.to_dict()["scaling"]["factor"] == 4.0
    plain = RotarySpec.from_config(config_of("llama", head_dim=16))
    assert plain.to_dict() == {"rope_type": "default", "theta": 10000.0, "head_dim": 16, "max_positions": 512}
