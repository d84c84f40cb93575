"""Each control passes on sound input and fails on input broken on purpose."""
import shutil

import pytest
import torch
from conftest import ROOT, build_model, tiny_config, train_tokenizer
from test_select import linear_copy_mapper

from pipeline import controls
from pipeline.controls import (
    Float32Tolerance,
    cached_decode,
    compatibility,
    corruption,
    deterministic_refit,
    rope_round_trip,
    serialization,
)
from pipeline.kv.handoff import Handoff
from pipeline.kv.kvcache import cache_to_layers
from pipeline.kv.mapper import save_mapper
from pipeline.kv.rope import RotarySpec
from pipeline.store.artifacts import ArtifactError, save_artifact


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config(97, 64), seed=0)


@pytest.fixture(scope="module")
def layers(model):
    with torch.no_grad():
        return cache_to_layers(model.model(input_ids=torch.randint(0, 97, (1, 30)), use_cache=True).cache)


def test_compatibility(tokenizer, model):
    assert compatibility(tokenizer, tokenizer, model.config, model.config)["passed"]
    other = train_tokenizer(["some other words entirely"] * 5, vocab_size=280)
    assert not compatibility(other, tokenizer, model.config, model.config)["passed"]


def test_cache_serialization(tmp_path, layers):
    assert serialization(layers, tmp_path)["passed"]

    def lossy_write(path, tensors, metadata):
        save_artifact(path, {k: t.to(torch.bfloat16).to(t.dtype) for k, t in tensors.items()}, metadata)

    assert not serialization(layers, tmp_path, write=lossy_write)["passed"]


class NoisyHandoff(Handoff):
    """A handoff whose prefix cache is slightly wrong, as a buggy transfer would be."""

    def prefix_layers(self, prefix_ids):
        return [(k + 0.05 * torch.randn_like(k), v) for k, v in super().prefix_layers(prefix_ids)]


def test_cached_decode(tmp_path, model):
    generator = torch.Generator().manual_seed(0)
    prompts = [(torch.randint(0, 97, (20,), generator=generator).tolist(),
                torch.randint(0, 97, (6,), generator=generator).tolist())
               for _ in range(4)]
    tolerance = Float32Tolerance(loglikelihood_abs=1e-4)
    good = cached_decode(model, prompts, tolerance, horizon=4, folder=tmp_path)
    assert good["passed"] and good["max_abs_delta_logprob"] < 1e-4
    torch.manual_seed(0)
    bad = cached_decode(model, prompts, tolerance, horizon=4, folder=tmp_path, handoff_cls=NoisyHandoff)
    assert not bad["passed"] and bad["max_abs_delta_logprob"] > 1e-4


def test_corruption_detection(tmp_path, model):
    path = tmp_path / "mapper.safetensors"
    save_mapper(linear_copy_mapper(model, 0.0, 1.0), path)
    (tmp_path / "scratch").mkdir()
    assert corruption(path, 32, tmp_path / "scratch")["passed"]
    from safetensors.torch import load_file  # reads tensors without checking any checksum

    result = corruption(path, 32, tmp_path / "scratch", loader=load_file)
    assert not result["passed"] and result["flips_accepted"] > 0


def test_rope_round_trip(layers, model, monkeypatch):
    spec = RotarySpec.from_config(model.config)
    assert rope_round_trip(layers, spec)["passed"]
    original = controls.apply_rope  # re-encoding one position off, as an indexing bug would
    monkeypatch.setattr(controls, "apply_rope", lambda keys, positions, spec_: original(keys, positions + 1, spec_))
    assert not rope_round_trip(layers, spec)["passed"]


def test_deterministic_mapper(tmp_path, model):
    mapper = tmp_path / "mapper.safetensors"
    save_mapper(linear_copy_mapper(model, 0.0, 1.0), mapper)

    def faithful(out):
        out.mkdir(parents=True)
        shutil.copyfile(mapper, out / "cand.safetensors")

    def drifting(out):
        out.mkdir(parents=True)
        save_mapper(linear_copy_mapper(model, 1e-6, 1.0, seed=int(out.name[-1])), out / "cand.safetensors")

    assert deterministic_refit(mapper, "cand", tmp_path / "a", refit=faithful)["passed"]
    result = deterministic_refit(mapper, "cand", tmp_path / "b", refit=drifting)
    assert not result["passed"] and not result["identical_refits"]


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
