"""Each control passes on sound input and fails on input broken on purpose."""
import shutil

import pytest
import torch
from helpers import ROOT, build_model, tiny_config, train_tokenizer
from helpers.architectures import SUPPORTED, VOCAB, linear_copy_mapper, random_of
from transformers import AutoConfig, AutoModelForCausalLM

from pipeline import controls
from pipeline.controls import (
    cached_decode,
    compatibility,
    corruption,
    deterministic_refit,
    rope_against_model,
    serialization,
)
from pipeline.kv.contract import pair_contract
from pipeline.kv.handoff import Handoff
from pipeline.kv.kvcache import cache_to_layers, pre_rope_keys
from pipeline.kv.mapper import save_mapper
from pipeline.kv.rope import RotarySpec, Rotation
from pipeline.schema.controls import Float32Tolerance, ReducedTolerance
from pipeline.store.artifacts import ArtifactError, save_artifact


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config(97, 64), seed=0)


@pytest.fixture(scope="module")
def layers(model):
    with torch.no_grad():
        return cache_to_layers(model.model(input_ids=torch.randint(0, 97, (1, 30)), use_cache=True).cache)


def test_compatibility_passes_on_one_tokenizer_and_fails_on_two(tokenizer, model):
    assert compatibility(pair_contract(model.config, model.config, tokenizer, tokenizer))["passed"]
    other = train_tokenizer(["some other words entirely"] * 5, vocab_size=280)
    result = compatibility(pair_contract(model.config, model.config, tokenizer, other))
    assert not result["passed"] and result["tokenizers"] == "different"
    assert "different tokenizers" in result["modes"]["mapped"]


def test_cache_serialization(tmp_path, layers, monkeypatch):
    assert serialization(layers, tmp_path)["passed"]

    def lossy_write(path, tensors, metadata):
        save_artifact(path, {k: t.to(torch.bfloat16).to(t.dtype) for k, t in tensors.items()}, metadata)

    monkeypatch.setattr(controls, "save_artifact", lossy_write)
    assert not serialization(layers, tmp_path)["passed"]


class NoisyHandoff(Handoff):
    """A handoff whose prefix cache is slightly wrong, as a buggy transfer would be."""

    def prefix_layers(self, prefix_ids, lengths=None):
        return [(k + 0.05 * torch.randn_like(k), v) for k, v in super().prefix_layers(prefix_ids, lengths)]


def test_cached_decode(tmp_path, model):
    generator = torch.Generator().manual_seed(0)
    prompts = [(torch.randint(0, 97, (20,), generator=generator).tolist(),
                torch.randint(0, 97, (6,), generator=generator).tolist())
               for _ in range(4)]
    tolerance = Float32Tolerance(noise_multiple=8.0, rope_relative=1e-5)
    good = cached_decode(model, prompts, tolerance, horizon=4, folder=tmp_path)
    assert good["passed"] and good["max_abs_delta_logprob"] <= good["allowed_abs_delta"] < 1e-4
    torch.manual_seed(0)
    bad = cached_decode(model, prompts, tolerance, horizon=4, folder=tmp_path, handoff_cls=NoisyHandoff)
    assert not bad["passed"] and bad["max_abs_delta_logprob"] > bad["allowed_abs_delta"]


def _deep_config():
    """30 layers at reduced width: a real model's depth, whose float32 rounding a fixed 1e-4 would not allow."""
    return AutoConfig.for_model("llama", vocab_size=2000, hidden_size=384, intermediate_size=1152,
                                num_hidden_layers=30, num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                                max_position_embeddings=512, initializer_range=0.1)


def _deep_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_deep_config()).eval()


@pytest.mark.slow
def test_cached_decode_tolerance_scales_with_a_deep_models_noise_floor_and_still_fails_a_wrong_cache(tmp_path):
    model = _deep_model()
    generator = torch.Generator().manual_seed(1)
    prompts = [(torch.randint(0, 2000, (40,), generator=generator).tolist(),
                torch.randint(0, 2000, (8,), generator=generator).tolist()) for _ in range(3)]
    tolerance = Float32Tolerance(noise_multiple=8.0, rope_relative=1e-5)
    good = cached_decode(model, prompts, tolerance, horizon=4, folder=tmp_path)
    assert good["passed"], good
    assert good["noise_floor"] > 1e-5  # the depth's rounding: a 3-layer model's floor is about 1e-6
    torch.manual_seed(0)
    bad = cached_decode(model, prompts, tolerance, horizon=4, folder=tmp_path, handoff_cls=NoisyHandoff)
    assert not bad["passed"] and bad["max_abs_delta_logprob"] > 10 * bad["allowed_abs_delta"]


class ReversedPrefixHandoff(Handoff):
    """A handoff that injects the cache of another text (the prefix reversed), as a stale cache would be."""

    def prefix_layers(self, prefix_ids, lengths=None):
        return super().prefix_layers(prefix_ids.flip(-1), lengths)


BFLOAT16 = ReducedTolerance(decision_margin=0.05, noise_multiple=4.0)


def _bfloat16_of(config):
    """A model built in bfloat16, its rotary buffer in float32 as a checkpoint loaded in bfloat16 has it."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()


def _random_prompts(vocab, count, context, continuation, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (context,), generator=generator).tolist(),
             torch.randint(0, vocab, (continuation,), generator=generator).tolist()) for _ in range(count)]


def test_bfloat16_cached_decode_passes_the_oracle_path_and_fails_a_cache_of_another_text(tmp_path):
    model = _bfloat16_of(tiny_config(97, 64))
    prompts = _random_prompts(97, 4, 20, 6)
    good = cached_decode(model, prompts, BFLOAT16, horizon=2, folder=tmp_path)
    assert good["passed"] and good["dtype"] == "bfloat16" and good["flips_unexplained"] == 0, good
    bad = cached_decode(model, prompts, BFLOAT16, horizon=2, folder=tmp_path, handoff_cls=ReversedPrefixHandoff)
    assert not bad["passed"] and bad["max_abs_delta_logprob"] > bad["allowed_abs_delta"]


@pytest.mark.slow
def test_bfloat16_cached_decode_is_calibrated_on_a_deep_models_own_rounding_and_still_fails_a_wrong_cache(tmp_path):
    model = _bfloat16_of(_deep_config())
    good = cached_decode(model, _random_prompts(2000, 8, 40, 16), BFLOAT16, horizon=1, folder=tmp_path)
    # the depth's bfloat16 rounding: a fixed margin of 0.05 would take its flipped near-ties for a broken cache
    assert good["passed"] and good["noise_floor"] > 4 * BFLOAT16.decision_margin, good
    assert good["flipped_under_margin"] + good["flipped_in_chunked_too"] >= good["decisions_flipped"]
    torch.manual_seed(0)
    bad = cached_decode(model, _random_prompts(2000, 2, 40, 8), BFLOAT16, horizon=1, folder=tmp_path,
                        handoff_cls=NoisyHandoff)
    assert not bad["passed"] and bad["max_abs_delta_logprob"] > bad["allowed_abs_delta"], bad


def test_corruption_detection(tmp_path, model, monkeypatch):
    path = tmp_path / "mapper.safetensors"
    save_mapper(linear_copy_mapper(model, 0.0, 1.0), path)
    (tmp_path / "scratch").mkdir()
    assert corruption(path, 32, tmp_path / "scratch")["passed"]
    from safetensors.torch import load_file  # reads tensors without checking any checksum

    monkeypatch.setattr(controls, "load_mapper", load_file)
    result = corruption(path, 32, tmp_path / "scratch")
    assert not result["passed"] and result["flips_accepted"] > 0


def _prompts(vocab, count=3, length=40, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=generator).tolist() for _ in range(count)]


def test_rope_control_passes_when_stripped_keys_equal_the_models_keys_before_rope(model):
    result = rope_against_model(model, _prompts(97), RotarySpec.from_model(model), 1e-5)
    assert result["passed"] and result["max_relative_error"] < 1e-6 and result["positions_checked"] == 40


def off_by_one(monkeypatch):
    """The control strips the keys one position past the one the model rotated them at."""
    monkeypatch.setattr(controls, "Rotation", lambda spec, positions: Rotation(spec, positions + 1))


def test_rope_control_fails_on_an_off_by_one_position(model, monkeypatch):
    off_by_one(monkeypatch)
    result = rope_against_model(model, _prompts(97), RotarySpec.from_model(model), 1e-5)
    assert not result["passed"] and result["max_relative_error"] > 0.1


def test_rope_control_fails_on_a_wrong_theta(model):
    spec = RotarySpec.from_model(model)
    wrong = RotarySpec.default(spec.theta * 2, spec.head_dim, spec.max_positions)
    assert not rope_against_model(model, _prompts(97), wrong, 1e-5)["passed"]


def test_rope_control_fails_on_partial_rotary_treated_as_full():
    config = AutoConfig.for_model("phi", vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    phi = AutoModelForCausalLM.from_config(config).eval()
    assert config.rope_parameters["partial_rotary_factor"] == 0.5
    as_full = RotarySpec.default(config.rope_parameters["rope_theta"], 16, 512)
    result = rope_against_model(phi, _prompts(97), as_full, 1e-5)
    assert not result["passed"] and result["max_relative_error"] > 0.1


def test_rope_control_fails_on_a_bfloat16_inv_freq(model):
    rotary = model.model.rotary_emb
    exact = rotary.inv_freq.clone()
    spec = RotarySpec.from_model(model)
    try:
        rotary.inv_freq = exact.to(torch.bfloat16)  # what model.to(torch.bfloat16) does to the buffer
        result = rope_against_model(model, _prompts(97), spec, 1e-5)
    finally:
        rotary.inv_freq = exact
    assert not result["passed"] and result["max_relative_error"] > 1e-3


def test_deterministic_mapper(tmp_path, model, monkeypatch):
    mapper = tmp_path / "mapper.safetensors"
    save_mapper(linear_copy_mapper(model, 0.0, 1.0), mapper)

    def faithful(out, name):
        out.mkdir(parents=True)
        shutil.copyfile(mapper, out / f"{name}.safetensors")

    def drifting(out, name):
        out.mkdir(parents=True)
        save_mapper(linear_copy_mapper(model, 1e-6, 1.0, seed=1), out / f"{name}.safetensors")

    monkeypatch.setattr(controls, "refit_in_subprocess", faithful)
    assert deterministic_refit(mapper, "cand", tmp_path / "a")["passed"]
    monkeypatch.setattr(controls, "refit_in_subprocess", drifting)
    result = deterministic_refit(mapper, "cand", tmp_path / "b")
    assert not result["passed"] and not result["matches_selected_file"]


def test_a_damaged_selected_mapper_is_named_by_its_checksum_first(tmp_path, model, monkeypatch):
    (tmp_path / "models").mkdir()
    save_mapper(linear_copy_mapper(model, 0.0, 1.0), tmp_path / "models" / "mapper.safetensors")
    raw = bytearray((tmp_path / "models" / "mapper.safetensors").read_bytes())
    raw[-3] ^= 0x01
    (tmp_path / "models" / "mapper.safetensors").write_bytes(raw)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)  # no models, caches or data here: the checksum must stop it before they are read
    with pytest.raises(ArtifactError, match=r"models/mapper\.safetensors.*(checksum|digest)"):
        controls.main([])


def test_the_verdict_holds_each_controls_pass_and_none_of_its_figures():
    results = {"cached_decode_float32": {"passed": True, "max_abs_delta_logprob": 7.6e-06, "noise_floor": 9.5e-06},
               "corruption_detection": {"passed": False, "flips_accepted": 1}}
    assert controls.verdict(results) == {"cached_decode_float32": True, "corruption_detection": False}


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_rope_control_passes_on_keys_a_thousand_times_larger_and_still_fails_off_by_one(architecture, monkeypatch):
    config = SUPPORTED[architecture]()
    if architecture == "qwen2":
        assert config.model_type == "qwen2"  # biased q/k/v: real Qwen2 keys reach the hundreds
    large = random_of(config)
    with torch.no_grad():
        for layer in large.model.layers:
            layer.self_attn.k_proj.weight.mul_(1000.0)
            if layer.self_attn.k_proj.bias is not None:
                layer.self_attn.k_proj.bias.add_(1000.0)
    spec = RotarySpec.from_model(large)
    before, _ = pre_rope_keys(large, _prompts(VOCAB)[0])
    assert float(before[0].abs().max()) > 100.0
    result = rope_against_model(large, _prompts(VOCAB), spec, 1e-5)
    assert result["passed"] and result["round_trip_relative_error"] < 1e-6
    off_by_one(monkeypatch)
    shifted = rope_against_model(large, _prompts(VOCAB), spec, 1e-5)
    assert not shifted["passed"] and shifted["max_relative_error"] > 0.1
