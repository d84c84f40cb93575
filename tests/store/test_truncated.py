"""`models.source: self:<n>`: the target's own first n decoder layers as the source, no second model. Its config
and tokenizer are the target's, its weights are the target's (shared, never copied), its cache at its layers is
the target's own; every loader, the pins and pointers, the contract, check_pair, check_params, extract, fit and
the handoff accept it, and the report names it."""
import json
import shutil

import pandas as pd
import pytest
import torch
import yaml
from helpers import ROOT, build_model, committed, pin_and_prepare, tiny_config
from helpers.kvworld import write_sequences

import pipeline.kv.pair as pair_module
from pipeline import check_pair
from pipeline.check_params import check
from pipeline.extract import run as extract
from pipeline.fit import run as fit
from pipeline.kv.flops import handoff_macs, matched_self_layers
from pipeline.kv.kvcache import cache_to_layers
from pipeline.kv.pair import Pair
from pipeline.kv.scoring import score_continuations
from pipeline.schema.extract import ExtractParams
from pipeline.schema.fit import FitParams
from pipeline.store.cachefiles import open_split
from pipeline.store.models import (
    ModelsParams,
    load_config,
    load_model,
    load_tokenizer,
    read_pointer,
    tokenizer_fingerprint,
)
from pipeline.store.params import ParamError, parse
from pipeline.store.shapes import pair_configs, shape_config
from pipeline.store.truncated import truncate
from pipeline.studies.run import pair_names
from pipeline.studies.variants import model_phrase

LAYERS = 3  # the target's; the self source takes 2 of them


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer):
    """models/target (3 layers, with the tokenizer), models/source its self:2 pointer, fit/select sequences."""
    root = tmp_path_factory.mktemp("self")
    build_model(tiny_config(len(tokenizer), 64, layers=LAYERS), seed=1).save_pretrained(root / "models" / "target")
    tokenizer.save_pretrained(root / "models" / "target")
    (root / "models" / "source").mkdir()
    (root / "models" / "source" / "self.json").write_text(json.dumps({"layers": 2, "target": "../target"}))
    write_sequences(root / "data" / "fit.parquet", 10, 24, 0, "fit")
    write_sequences(root / "data" / "select.parquet", 4, 24, 1, "select")
    return root


def _target_and_source(world):
    target = load_model(str(world / "models" / "target"), device="cpu")
    return target, truncate(target, 2)


def test_a_self_source_is_the_targets_first_layers_sharing_its_weights_and_its_tied_head(world):
    target, source = _target_and_source(world)
    assert source.config.num_hidden_layers == 2 and len(source.model.layers) == 2
    assert source.config.layer_types == target.config.layer_types[:2]
    assert target.config.num_hidden_layers == LAYERS and len(target.model.layers) == LAYERS  # the target is untouched
    target_storage = {param.data_ptr() for param in target.parameters()}
    assert {param.data_ptr() for param in source.parameters()} <= target_storage  # no weight copied
    assert source.lm_head.weight is source.model.embed_tokens.weight is target.model.embed_tokens.weight
    assert source.model.norm is target.model.norm


def test_the_self_sources_cache_is_the_targets_own_cache_at_its_layers(world):
    target, source = _target_and_source(world)
    ids = torch.tensor([[5, 9, 14, 3, 8, 21, 2, 40]])
    with torch.no_grad():
        own = cache_to_layers(target.model(input_ids=ids, use_cache=True).cache)
        cut = cache_to_layers(source.model(input_ids=ids, use_cache=True).cache)
    assert len(cut) == 2
    for (keys, values), (own_keys, own_values) in zip(cut, own):
        assert torch.equal(keys, own_keys) and torch.equal(values, own_values)
    assert not torch.allclose(own[2][0], own[1][0])  # the deeper layer is another cache: the maps' work


@pytest.mark.parametrize("name, message", [
    ("self:0", r"^models\.source: 'self:0' is not self:<n> .*n >= 1"),
    ("self:two", r"^models\.source: 'self:two' is not self:<n>"),
    ("self:3", r"^models\.source: self:3 asks for 3 of the target's 3 decoder layers; use self:<n> with 1 <= n <= 2$"),
])
def test_a_self_source_outside_one_to_the_targets_layers_is_refused_in_one_line_naming_the_key(world, name, message):
    with pytest.raises(ParamError, match=message):
        load_config(name, target=str(world / "models" / "target"))


def test_the_bare_name_without_its_target_is_refused_naming_the_key_and_the_fix():
    with pytest.raises(ParamError, match=r"^models\.source: 'self:2' is the target's first 2 layers.*name the target"):
        load_tokenizer("self:2")


def test_a_prepared_self_pointer_loads_the_targets_config_tokenizer_and_first_layers(world):
    source_dir, target_dir = str(world / "models" / "source"), str(world / "models" / "target")
    assert read_pointer(source_dir)["kind"] == "self"
    config = load_config(source_dir)
    assert config.num_hidden_layers == 2 and config.hidden_size == load_config(target_dir).hidden_size
    assert tokenizer_fingerprint(load_tokenizer(source_dir)) == tokenizer_fingerprint(load_tokenizer(target_dir))
    source, target = load_model(source_dir, device="cpu"), load_model(target_dir, device="cpu")
    own = dict(target.named_parameters())
    assert all(torch.equal(param, own[name]) for name, param in source.named_parameters())


def test_the_contract_defines_the_mapped_handoff_with_one_tokenizer_and_refuses_direct_for_the_missing_layers(world):
    contract = Pair(str(world / "models" / "target"), str(world / "models" / "source")).contract
    assert contract.tokenizers == "identical" and contract.defined("mapped") and contract.defined("source")
    assert contract.family_defined("linear") and contract.family_defined("head_matched")
    assert "equal KV geometry" in contract.modes["direct"] and "'layers': 2" in contract.modes["direct"]


def test_the_pair_cuts_its_source_from_its_own_target_loading_the_weights_once(world, monkeypatch):
    loaded = []

    def counted(name, *args, **kwargs):
        loaded.append(name)
        return load_model(name, *args, **kwargs)

    monkeypatch.setattr(pair_module, "load_model", counted)
    pair = Pair(str(world / "models" / "target"), "self:2", device="cpu")
    source = pair.handoff("source").decoder  # the source alone decodes with the source model
    assert loaded == [str(world / "models" / "target")]
    assert source.model.embed_tokens is pair.target.model.embed_tokens and len(source.model.layers) == 2


def test_extract_and_fit_run_on_a_self_source_and_the_map_reproduces_the_shared_layers(world, tmp_path):
    for name in ("source", "target"):
        extract(world / "models" / name, name, world / "data", tmp_path / "caches" / name,
                parse(ExtractParams, committed("extract", dtype="float32", shard_sequences=5, repeats=1), "extract"))
    source_shard, target_shard = (open_split(tmp_path / "caches" / name, "fit")[0] for name in ("source", "target"))
    for layer in range(2):  # the extracted caches: the source's layers are the target's own, bit for bit
        for kind in ("keys", "values"):
            assert torch.equal(source_shard.read(kind, [layer])[0], target_shard.read(kind, [layer])[0])
    params = parse(FitParams, committed("fit", ks=[1, 2], lambdas=[1.0e-5], families=["linear"], timing_repeats=1,
                                        mlp={"ks": []}), "fit")
    metrics = fit(tmp_path / "caches" / "source", tmp_path / "caches" / "target", world / "models" / "source",
                  world / "data" / "select.parquet", tmp_path / "mappers", tmp_path / "metrics", params, {}, "cpu",
                  "float32")
    assert all(metrics[f"chosen/linear_k1/r2_{kind}_layer{layer}"] > 0.999 for kind in ("keys", "values")
               for layer in range(2))  # the shared layers: the map finds the identity
    pair = Pair(str(world / "models" / "target"), str(world / "models" / "source"), device="cpu")
    mapped = pair.handoff("mapped", tmp_path / "mappers" / "linear_k1_lam1e-05.safetensors")
    prefix = torch.tensor([pd.read_parquet(world / "data" / "select.parquet").token_ids[0].tolist()[:16]])
    mapped_layers, oracle_layers = mapped.prefix_layers(prefix), pair.handoff("oracle").prefix_layers(prefix)
    for layer in range(2):
        for got, own in zip(mapped_layers[layer], oracle_layers[layer]):
            assert torch.allclose(got, own, atol=1e-3 * own.abs().max().item())
    scores = score_continuations(mapped, [([5, 9, 14, 3, 8], [7, 2])], progress=False)
    assert torch.isfinite(torch.tensor(scores[0][0]))


def test_pin_and_prepare_make_the_source_the_targets_pin_plus_n_and_a_pointer_without_weights(tmp_path, monkeypatch,
                                                                                               capsys):
    shutil.copytree(ROOT / "models" / "target", tmp_path / "ckpt" / "target")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["models"] = committed("models", kind="hub", source="self:2", target=str(tmp_path / "ckpt" / "target"))
    pin_and_prepare(tmp_path, params, monkeypatch)
    pins = json.loads((tmp_path / "models" / "pins.json").read_text())
    assert pins["source"] == {"kind": "self", "layers": 2, "target": pins["target"]}
    assert sorted(path.name for path in (tmp_path / "models" / "source").iterdir()) == ["self.json"]
    printed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert printed["modes"] == ["mapped", "oracle", "shuffled", "source", "speculative", "zero"]
    assert load_model("models/source", device="cpu").config.num_hidden_layers == 2
    assert pair_names() == ("self:2", "ckpt/target")  # inside the working directory: named relative to it


def test_the_report_names_a_self_source_as_the_targets_first_layers():
    assert model_phrase("self:9") == "the target's first 9 layers (`self:9`)"
    assert model_phrase("self:1") == "the target's first layer (`self:1`)"
    assert model_phrase("Qwen/Qwen3-0.6B") == "`Qwen/Qwen3-0.6B`"


def _params(**models) -> dict:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["models"] = {**params["models"], **models}
    return params


def test_check_params_refuses_a_self_source_as_deep_as_the_target_and_reads_n_as_the_sources_depth():
    with pytest.raises(ParamError, match=r"^models\.source: self:3 asks for 3 of the target's 3 decoder layers"):
        check(_params(source="self:3"))
    with pytest.raises(ParamError, match=r"^fit\.ks: k=3 exceeds the source's 2 layers \(trained self:2\)"):
        check(_params(source="self:2"))
    with pytest.raises(ParamError, match=r"^models\.source: self:28 asks for 28 of the target's 28 decoder layers"):
        check(_params(kind="random", source="self:28", target="qwen3-1.7b"))
    with pytest.raises(ParamError, match=r"^models\.target: 'self:2'.*belongs in models\.source"):
        parse(ModelsParams, committed("models", target="self:2"), "models")


def test_check_params_accepts_a_trained_self_source_without_its_own_training_settings():
    params = _params(source="self:2")
    params["train"]["source"] = None
    params["fit"]["ks"], params["fit"]["mlp"]["ks"] = [1], [1]
    with pytest.raises(ParamError, match=r"is not a map of the fit grid"):  # past the self source's own rules
        check(params)


def test_the_matched_self_source_of_v0s_pair_is_9_of_28_layers_and_check_pair_prints_it(capsys):
    source, target = pair_configs("qwen3-v0")
    assert [matched_self_layers(source, target, length) for length in (128, 512)] == [9, 9]
    at_9 = handoff_macs(shape_config("qwen3-1.7b"), target, 0, 512)["source"] * 9 / 28
    assert abs(at_9 / handoff_macs(source, target, 0, 512)["source"] - 1) < 0.05
    check_pair.main(["shape:qwen3-0.6b", "shape:qwen3-1.7b", "--ks", "1", "--lengths", "512"])
    assert "self:9 matches the source's prefill cost at 512 tokens (the target's first 9 of 28 layers)" in \
        capsys.readouterr().out


def test_check_pair_takes_a_self_source_with_its_target(world, capsys):
    check_pair.main(["self:1", str(world / "models" / "target"), "--ks", "1", "--lengths", "16"])
    out = capsys.readouterr().out
    assert out.startswith(f"# self:1 -> {world / 'models' / 'target'}")
    assert "tokenizers: identical" in out and "| mapped | yes |" in out and "1 / 2 / 16" in out
    assert "matches the source's prefill cost" not in out  # a self source is its own matched baseline
