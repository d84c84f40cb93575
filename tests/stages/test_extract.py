"""Extract stage: content-space keys that re-rotate to the model's own cache, shards, manifest and timing floors."""
import json

import pandas as pd
import pytest
import torch
from helpers import committed
from helpers.kvworld import make_world
from transformers import AutoConfig

from pipeline import extract as extract_module
from pipeline.extract import batches, run
from pipeline.kv.contract import UnsupportedModelError
from pipeline.kv.kvcache import cache_to_layers
from pipeline.kv.rope import RotarySpec, Rotation
from pipeline.schema.extract import ExtractParams
from pipeline.store.cachefiles import open_split
from pipeline.store.models import load_model
from pipeline.store.params import parse


def extract_params(**overrides) -> ExtractParams:
    return parse(ExtractParams, committed("extract", **{"dtype": "float32", "repeats": 1, **overrides}), "extract")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = make_world(tmp_path_factory.mktemp("extract"), fit=7, select=3, length=20)
    metrics = run(root / "models" / "source", "source", root / "data", root / "caches" / "source",
                  extract_params(shard_sequences=3))
    return root, metrics


def test_stored_keys_rerotated_equal_the_models_cache(world):
    root, _ = world
    model = load_model(str(root / "models" / "source"), device="cpu")
    spec = RotarySpec.from_config(model.config)
    shard = open_split(root / "caches" / "source", "fit")[0]
    token_ids = pd.read_parquet(root / "data" / "fit.parquet").token_ids[0].tolist()
    with torch.no_grad():
        cached = cache_to_layers(model.model(input_ids=torch.tensor([token_ids]), use_cache=True).cache)
    length, heads, dim = len(token_ids), model.config.num_key_value_heads, model.config.head_dim
    assert shard.lengths[0] == length
    for layer, (keys, values) in enumerate(cached):
        keys_content = shard.read("keys", [layer])[0][:length].reshape(length, heads, dim).transpose(0, 1)  # (H, T, D)
        keys_rotated = Rotation(spec, torch.arange(length)).apply(keys_content)
        assert torch.allclose(keys_rotated, keys[0], atol=1e-5)
        assert not torch.allclose(keys_content, keys[0], atol=1e-3)  # really stripped, not stored rotated
        stored_values = shard.read("values", [layer])[0][:length].reshape(length, heads, dim).transpose(0, 1)
        assert torch.equal(stored_values, values[0])


def test_the_ablations_caches_keep_rope_and_say_so(world, tmp_path):
    root, _ = world
    run(root / "models" / "source", "source", root / "data", tmp_path / "rotated", extract_params(shard_sequences=3),
        keep_rope=True)
    model = load_model(str(root / "models" / "source"), device="cpu")
    token_ids = pd.read_parquet(root / "data" / "fit.parquet").token_ids[0].tolist()
    with torch.no_grad():
        cached = cache_to_layers(model.model(input_ids=torch.tensor([token_ids]), use_cache=True).cache)
    length, heads, dim = len(token_ids), model.config.num_key_value_heads, model.config.head_dim
    shard = open_split(tmp_path / "rotated", "fit")[0]
    for layer, (keys, _) in enumerate(cached):
        stored = shard.read("keys", [layer])[0][:length].reshape(length, heads, dim).transpose(0, 1)  # (H, T, D)
        assert torch.equal(stored, keys[0])  # as cached: no strip, no round trip
    manifest = json.loads((tmp_path / "rotated" / "manifest.json").read_text())
    assert manifest["keys"].startswith("rotated")
    assert json.loads((root / "caches" / "source" / "manifest.json").read_text())["keys"].startswith("content")


def test_shards_hold_every_sequence_in_order(world):
    root, _ = world
    manifest = json.loads((root / "caches" / "source" / "manifest.json").read_text())
    assert [len(manifest["splits"][s]["shards"]) for s in ("fit", "select")] == [3, 1]  # 7 = 3 + 3 + 1 sequences
    shards = open_split(root / "caches" / "source", "fit")
    assert [d for s in shards for d in s.doc_ids] == [f"fit-{i}" for i in range(7)]
    assert manifest["splits"]["fit"]["tokens"] == sum(s.tokens for s in shards)


def test_metrics_report_extraction_beside_both_floors(world):
    _, metrics = world
    assert metrics["forward_floor_s"] > 0 and metrics["write_floor_s"] > 0
    assert metrics["ratio_to_floor"] == pytest.approx(
        metrics["extract_s"] / max(metrics["forward_floor_s"], metrics["write_floor_s"]), rel=1e-2)


def test_repeated_timing_rewrites_the_same_bytes(world, tmp_path):
    root, _ = world
    metrics = run(root / "models" / "source", "source", root / "data", tmp_path,
                  extract_params(shard_sequences=3, repeats=2))
    assert metrics["repeats"] == 2
    once = open_split(root / "caches" / "source", "fit")
    twice = open_split(tmp_path, "fit")
    assert [s.path.read_bytes() for s in once] == [s.path.read_bytes() for s in twice]
    assert sorted(p.name for p in (tmp_path / "fit").iterdir()) == [s.path.name for s in twice]  # no leftovers


def test_model_runs_in_the_declared_dtype_and_only_the_strip_is_float32(world, tmp_path):
    root, _ = world
    run(root / "models" / "source", "source", root / "data", tmp_path, extract_params(shard_sequences=3), "bfloat16")
    assert json.loads((tmp_path / "manifest.json").read_text())["model_dtype"] == "bfloat16"
    model = load_model(str(root / "models" / "source"), dtype="bfloat16", device="cpu")
    spec = RotarySpec.from_config(model.config)
    token_ids = pd.read_parquet(root / "data" / "fit.parquet").token_ids[0].tolist()
    with torch.no_grad():
        cached = cache_to_layers(model.model(input_ids=torch.tensor([token_ids]), use_cache=True).cache)
    shard = open_split(tmp_path, "fit")[0]
    length, heads, dim = len(token_ids), model.config.num_key_value_heads, model.config.head_dim
    for layer, (keys, values) in enumerate(cached):  # the bfloat16 model's own cache, not a float32 forward's
        stored_values = shard.read("values", [layer])[0][:length].reshape(length, heads, dim).transpose(0, 1)
        assert torch.equal(stored_values, values[0].float())
        keys_content = shard.read("keys", [layer])[0][:length].reshape(length, heads, dim).transpose(0, 1)
        assert torch.allclose(Rotation(spec, torch.arange(length)).apply(keys_content), keys[0].float(), atol=1e-5)


def test_a_model_with_an_active_sliding_window_is_refused_before_it_is_loaded(tmp_path, monkeypatch):
    root = make_world(tmp_path, fit=2, select=2, length=24)
    config = AutoConfig.from_pretrained(root / "models" / "target")
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 8, 0
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    config.save_pretrained(root / "models" / "target")
    monkeypatch.setattr(extract_module, "load_model", lambda *a, **k: pytest.fail("the weights were loaded"))
    with pytest.raises(UnsupportedModelError, match="sliding window of 8 tokens, active at 24"):
        extract_module.run(root / "models" / "target", "target", root / "data", tmp_path / "caches",
                           parse(ExtractParams, committed("extract", repeats=1), "extract"))


def test_batches_are_runs_of_equal_length_in_order():
    assert batches([5, 5, 5, 3, 3, 5], 2) == [range(0, 2), range(2, 3), range(3, 5), range(5, 6)]
    assert batches([], 4) == []


def test_batched_extraction_stores_what_one_sequence_at_a_time_stores(world, tmp_path):
    root, _ = world
    stored = {}
    for size in (1, 4):
        out = tmp_path / f"batch{size}"
        run(root / "models" / "target", "target", root / "data", out, extract_params(batch_sequences=size))
        stored[size] = [torch.cat(shard.read(kind, [0, 1])) for split in ("fit", "select")
                        for shard in open_split(out, split) for kind in ("keys", "values")]
    for one, batched in zip(stored[1], stored[4]):
        assert torch.allclose(one, batched, atol=1e-5, rtol=0)
