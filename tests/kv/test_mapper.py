"""Mapper families: batched application equals the per-head definition; the file format round-trips; the
multiply-adds a mapper reports are the ones mapping a token performs."""
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pipeline.kv.flops import mapper_macs_per_token, mapper_parameter_count
from pipeline.kv.mapper import Mapper, load_mapper, save_mapper
from pipeline.store.artifacts import ArtifactError

SOURCE = {"layers": 3, "kv_heads": 2, "head_dim": 4}
TARGET = {"layers": 2, "kv_heads": 2, "head_dim": 6}
ROTARY = {"rope_type": "default", "theta": 10000.0, "head_dim": 4, "max_positions": 64}


def _mapper(family: str, k: int = 2, hidden: int = 5) -> Mapper:
    """Random tensors of `family`'s shapes; `hidden`: the mlp family's width, the low_rank family's rank."""
    generator = torch.Generator().manual_seed(0)
    width = k * SOURCE["head_dim"] * (1 if family == "head_matched" else SOURCE["kv_heads"])
    heads, dim = TARGET["kv_heads"], TARGET["head_dim"]
    shapes = {"mlp": [(width, hidden), (hidden,), (heads, hidden, dim), (heads, dim)],
              "low_rank": [(width, hidden), (heads, hidden, dim), (heads, dim)]}.get(family, [(heads, width, dim),
                                                                                          (heads, dim)])

    def layer() -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(*shape, generator=generator) for shape in shapes)

    return Mapper(family, "src", "tgt", SOURCE, TARGET, ROTARY, dict(ROTARY, head_dim=6), k=k, ridge_lambda=0.1,
                  source_layers=[[0, 2], [1, 2]], keys=[layer(), layer()], values=[layer(), layer()])


def _source_cache(tokens=5):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(1, 2, tokens, 4, generator=generator), torch.randn(1, 2, tokens, 4, generator=generator))
            for _ in range(SOURCE["layers"])]


def test_linear_map_equals_per_head_definition():
    mapper, cache = _mapper("linear"), _source_cache()
    mapped = mapper.apply(cache)
    for layer, chosen in enumerate(mapper.source_layers):
        # input row per token: all source heads of each chosen layer, concatenated in layer order
        x = torch.cat([cache[s][0][0].transpose(0, 1).reshape(5, -1) for s in chosen], dim=-1)  # (T, k*H*D)
        for head in range(TARGET["kv_heads"]):
            weight, bias = mapper.keys[layer][0][head], mapper.keys[layer][1][head]
            assert torch.allclose(mapped[layer][0][0, head], x @ weight + bias, atol=1e-5)


def test_head_matched_map_reads_only_its_own_source_head():
    mapper, cache = _mapper("head_matched"), _source_cache()
    mapped = mapper.apply(cache)
    for layer, chosen in enumerate(mapper.source_layers):
        for head in range(TARGET["kv_heads"]):
            x = torch.cat([cache[s][1][0, head] for s in chosen], dim=-1)  # (T, k*D)
            weight, bias = mapper.values[layer][0][head], mapper.values[layer][1][head]
            assert torch.allclose(mapped[layer][1][0, head], x @ weight + bias, atol=1e-5)


@pytest.mark.parametrize("family", ["linear", "head_matched"])
def test_mapper_file_round_trip(tmp_path, family):
    mapper = _mapper(family)
    save_mapper(mapper, tmp_path / "m.safetensors")
    loaded = load_mapper(tmp_path / "m.safetensors")
    assert loaded.metadata() == mapper.metadata()
    cache = _source_cache()
    for (k1, v1), (k2, v2) in zip(mapper.apply(cache), loaded.apply(cache)):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_non_mapper_artifact_is_refused(tmp_path):
    from pipeline.store.artifacts import save_artifact

    save_artifact(tmp_path / "x.safetensors", {"w": torch.zeros(1)}, {"format": "something-else"})
    with pytest.raises(ArtifactError, match="not a mapper file"):
        load_mapper(tmp_path / "x.safetensors")


def test_identity_needs_equal_geometry():
    with pytest.raises(ValueError, match="equal KV geometry"):
        Mapper("identity", "src", "tgt", SOURCE, TARGET, ROTARY, ROTARY)


def test_mlp_map_round_trips_and_applies_one_hidden_layer(tmp_path):
    mapper = _mapper("mlp")
    save_mapper(mapper, tmp_path / "m.safetensors")
    loaded = load_mapper(tmp_path / "m.safetensors")
    cache = _source_cache()
    mapped = loaded.apply(cache)
    for index, chosen in enumerate(mapper.source_layers):
        x = torch.cat([cache[s][0][0].transpose(0, 1).reshape(5, -1) for s in chosen], dim=-1)  # (T, k*H*D)
        in_weight, in_bias, weight, bias = mapper.keys[index]
        hidden_rows = torch.nn.functional.gelu(x @ in_weight + in_bias)  # (T, hidden)
        for head in range(TARGET["kv_heads"]):
            assert torch.allclose(mapped[index][0][0, head], hidden_rows @ weight[head] + bias[head], atol=1e-5)


def _config(geometry: dict) -> SimpleNamespace:
    """The config fields `kv_geometry` reads, so the flops formulas see the geometry the mapper was built for."""
    return SimpleNamespace(num_hidden_layers=geometry["layers"], num_key_value_heads=geometry["kv_heads"],
                           head_dim=geometry["head_dim"])


@pytest.mark.parametrize("family", ["linear", "head_matched", "mlp", "low_rank"])
def test_the_reported_multiply_adds_are_those_mapping_one_token_performs(family):
    hidden, k = 5, 2
    mapper = _mapper(family, k, hidden)
    # counted, not derived: the matmuls torch runs to map one token (2 flops per multiply-add; bias adds,
    # gelu and concatenation are not multiply-adds and the counter leaves them out)
    with FlopCounterMode(display=False) as counter:
        mapper.apply(_source_cache(tokens=1))
    performed = counter.get_total_flops() // 2
    assert performed > 0
    assert mapper.macs_per_token() == performed
    configs = _config(SOURCE), _config(TARGET)
    assert mapper_macs_per_token(*configs, k, family, mapper.width) == performed
    stored = sum(t.numel() for tensors in mapper.keys + mapper.values for t in tensors)
    assert mapper_parameter_count(*configs, k, family, mapper.width) == stored
